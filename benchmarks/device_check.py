"""What only a GPU shows, in one short run: the script for a lent GPU machine.

    python benchmarks/device_check.py --size 1b --out results/device_check.json   # on a GPU
    python benchmarks/device_check.py --size tiny --out /tmp/check.json           # CPU smoke run

Each section is recorded as ok (with its numbers), skipped (with why: a package the machine lacks)
or failed (with the error); one failing section does not stop the others. On CPU the same code
runs at a tiny size so that the script is tested; its numbers mean nothing there.

0. te_specs (first, in seconds): every supported family's Transformer Engine layer spec built,
   its model made and its checkpoint loaded whole, when TE is importable (``device_specs.py``).
1. ceiling: the measured dense matrix-product rate (bf16 on GPU) and pinned host<->device copy
   bandwidth, the limits the learner's MFU and the offload/sync speeds are read against.
2. learner_bf16: the megatron-core learner (world size 1; NCCL on GPU) on a random model of the
   given size: tokens/s of a Mu-GRPO train step and model FLOPs utilisation, with
   6 x (non-embedding parameters + LM head) + 12 x layers x hidden x sequence FLOPs per token
   (forward + backward, attention included), against the datasheet peak and the measured one.
3. offload: the learner's weights, gradient buffers and Adam state to host memory and back.
4. reshard: the learner's shards streamed as full HF tensors (what a weight sync sends), against a
   device-to-host copy of the same bytes.
   packing: packed rows (THD through TE on a GPU) against padded ones on responses of varied
   lengths: log-prob difference and train-step speed-up.
5. learner_fp8: section 2 with FP8 (Transformer Engine, 'hybrid' format, delayed scaling), when TE
   is importable; then a batch whose length is a multiple of neither 8 nor 16 (TE's FP8 GEMMs
   refuse such token counts; the learner pads them: ``layout/shapes.py``), scored and trained;
   and TE's amax reductions counted per microbatch in updates of 1, 2 and 4 microbatches (the
   rule behind equal microbatch counts across data-parallel ranks: ``Learner._equal_count``).
6. engine: vLLM when importable: start-up with the learner offloaded, weight sync from the
   learner, generation tokens/s, sleep and wake times, and the train/inference log-prob gap of
   the engine's samples scored by the learner, in the training dtype.
7. transitions: device memory in use (``torch.cuda.mem_get_info``) and the allocator's peak at
   each transition of two phases with an evaluation, as the trainer orders them (the engine's
   part where vLLM is importable), against the dry run's estimate for the same model.
8. checkpoint: a learner save and load (the distributed optimizer's model-space layout): seconds,
   the host memory the save adds over the rank's own optimizer shard, weights bit-exact after.
9. moe_grouped: a tiny GLM-4.5 MoE whose experts run as TE's grouped GEMM (TEGroupedMLP), its
   log-probs against transformers' (``device_moe.py``), when TE is importable; then a tiny
   DeepSeek-V3, whose multi-latent attention runs TE's MLA spec (names the CPU never builds).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import random_batch, summarize, table, write_json  # noqa: E402
from device_phase import (  # noqa: E402
    checkpoint_section,
    fp8_amax_per_microbatch,
    fp8_odd_lengths,
    transitions_section,
)

SIZES = {  # random llama-shaped models
    "tiny": dict(hidden_size=256, ffn_hidden_size=704, num_heads=4, num_kv_heads=2, num_layers=2,
                 vocab_size=1024),
    "1b": dict(hidden_size=2048, ffn_hidden_size=5632, num_heads=16, num_kv_heads=4,
               num_layers=16, vocab_size=32000),
}
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16 (NVIDIA datasheet)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def ceiling(args) -> dict:
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    n = 8192 if cuda else 512
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    mm = summarize(timed(lambda: a @ b, repeats=10, warmup=3))
    out = {"matmul_n": n, "matmul_dtype": str(dtype), "matmul_tflops": 2 * n**3 / mm["median"] / 1e12}
    nbytes = (1 << 30) if cuda else (64 << 20)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = summarize(timed(lambda: device.copy_(host, non_blocking=True), repeats=5))
    d2h = summarize(timed(lambda: host.copy_(device, non_blocking=True), repeats=5))
    out.update(h2d_gb_s=nbytes / 1e9 / h2d["median"], d2h_gb_s=nbytes / 1e9 / d2h["median"])
    out["checked"] = [f"the {dtype} matrix-product rate at n={n}",
                      "pinned host <-> device copy bandwidth" if cuda else "host copy bandwidth"]
    out["not_checked"] = [] if cuda else ["a GPU: these are the CPU's numbers"]
    return out


def make_model(size: str) -> Path:
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    path = Path(tempfile.gettempdir()) / f"mugrpo_device_check_{size}"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, "llama", dtype="bfloat16", init_std=0.02,
                             max_position_embeddings=4096, **SIZES[size])
    return path


def make_learner(path: Path, args, fp8: bool):
    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.learner.learner import Learner

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    sets = [f"model.path={path}", f"model.dtype={dtype}", f"parallel.micro_batch_size={args.micro}",
            f"algo.samples_per_update={args.samples}", "algo.total_updates=64",
            "algo.updates_per_phase=64", "optim.lr=1e-6", "rollout.max_new_tokens=64",
            "rollout.gpu_memory_utilization=0.35", "parallel.distributed_optimizer=false"]
    if fp8:
        sets += ["model.fp8_format=hybrid", "model.fp8_recipe=delayed"]
    cfg = load_config(None, sets)
    return cfg, Learner.from_config(cfg)


def learner_section(path: Path, args, fp8: bool, state: dict) -> dict:
    cfg, learner = make_learner(path, args, fp8)
    spec = learner.spec
    batch = random_batch(args.samples, args.seq // 4, args.seq - args.seq // 4, spec.vocab_size)
    steps = [learner.train_step(batch) for _ in range(args.warmup + args.steps)][args.warmup:]
    seconds = summarize([s.seconds for s in steps])
    tokens = batch.tokens.numel()  # every position goes forward and backward
    matmul_params = spec.num_parameters() - spec.vocab_size * spec.hidden_size * (
        0 if spec.tie_embeddings else 1)  # the input embedding is a lookup, not a product
    flops = tokens * (6 * matmul_params + 12 * spec.num_layers * spec.hidden_size * args.seq)
    achieved = flops / seconds["median"] / 1e12
    out = {"params": spec.num_parameters(), "tokens_per_step": tokens, "step_s": seconds,
           "tokens_per_s": tokens / seconds["median"], "model_tflops": achieved,
           "mfu_vs_datasheet": achieved / DATASHEET_BF16_TFLOPS,
           "losses_finite": all(torch.isfinite(torch.tensor(s.loss)) for s in steps)}
    if state.get("ceiling"):
        out["mfu_vs_measured_matmul"] = achieved / state["ceiling"]["matmul_tflops"]
    if torch.cuda.is_available():
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    state["learner"], state["cfg"], state["batch"] = learner, cfg, batch
    kind = "FP8 (TE, hybrid, delayed scaling)" if fp8 else cfg.model.dtype
    out["checked"] = [f"megatron-core {_version('megatron-core')} train steps in {kind} at world "
                      f"size 1: finite losses, tokens/s, MFU",
                      "TE's layers" if learner.uses_thd else "megatron's local (torch) layers"]
    out["not_checked"] = ["TP, PP, DP and their NCCL collectives (one GPU)"] + (
        [] if learner.uses_thd else ["Transformer Engine's layers (not installed)"])
    return out


def offload_section(state: dict) -> dict:
    learner = state["learner"]
    out = {}
    for i in range(2):  # the first offload pins its host buffers; later ones reuse them
        off = learner.offload()
        if torch.cuda.is_available():
            out[f"allocated_gib_while_offloaded_{i}"] = torch.cuda.memory_allocated() / 2**30
        on = learner.onload()
        out[f"offload_{i}"] = {"seconds": off.seconds, "gib": off.bytes_freed / 2**30,
                               "copy_gb_s": off.bytes_copied / 1e9 / off.seconds}
        out[f"onload_{i}"] = {"seconds": on.seconds, "copy_gb_s": on.bytes_copied / 1e9 / on.seconds}
    out["checked"] = ["offload and onload of weights, gradient buffers and Adam state, twice (the "
                      "second reusing the pinned chunks)"]
    out["not_checked"] = ["that the engine's memory fills what the learner freed (no engine)"]
    return out


def reshard_section(state: dict, args) -> dict:
    from mugrpo_megatron.learner.export import iter_hf_tensors

    learner = state["learner"]
    nbytes = sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(learner.chunks(), learner.spec))

    def stream():
        for _ in iter_hf_tensors(learner.chunks(), learner.spec, bucket_bytes=256 << 20):
            pass

    cuda = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    reshard = summarize(timed(stream, repeats=3))
    copy = summarize(timed(lambda: dst.copy_(src, non_blocking=True), repeats=3))
    return {"bytes": nbytes, "reshard_s": reshard, "reshard_gb_s": nbytes / 1e9 / reshard["median"],
            "d2h_copy_gb_s": nbytes / 1e9 / copy["median"],
            "reshard_vs_copy": copy["median"] / reshard["median"],
            "checked": ["the export stream's throughput at TP1 (renaming, splitting q/k/v and "
                        "gate/up, copies) against a device-to-host copy"],
            "not_checked": ["TP gathers, the PP broadcast and the engine-sharded stream (one "
                            "GPU: TP and PP of 1)"]}


def packing_section(state: dict, args) -> dict:
    """Packed rows (THD through TE on a GPU, the masked path elsewhere) against padded ones on
    responses of varied lengths: the log-prob difference and the train-step speed of each."""

    from mugrpo_megatron.layout import round_up
    from mugrpo_megatron.learner.packing import sequence_lengths
    from mugrpo_megatron.phase.batches import padded_batch

    learner = state["learner"]
    g = torch.Generator().manual_seed(2)
    vocab, prompt = learner.spec.vocab_size, args.seq // 4
    rows = []
    for _ in range(args.samples):
        n = int(torch.randint(args.seq // 16, args.seq - prompt + 1, (1,), generator=g))
        rows.append((torch.randint(5, vocab, (prompt,), generator=g).tolist(),
                     torch.randint(5, vocab, (n,), generator=g).tolist(), [-3.0] * n))
    batch = padded_batch(rows, [float(i % 3 - 1) for i in range(len(rows))])
    out = {"padding_frac": 1 - sum(sequence_lengths(batch.response_mask)) / batch.tokens.numel()}
    # the learner reads its pack_capacity at each call: switch it for this comparison only
    own = learner.pack_capacity
    ways = (("padded", 0), ("packed", round_up(args.seq * 2, learner.token_multiple)))
    logps = {}
    for name, capacity in ways:  # same weights for both
        learner.pack_capacity = capacity
        logps[name], _ = learner.logprobs(batch)
    for name, capacity in ways:
        learner.pack_capacity = capacity
        out[name] = {"step_s": summarize([learner.train_step(batch).seconds for _ in range(3)])}
    learner.pack_capacity = own
    resp = batch.response_mask
    diff = (logps["padded"] - logps["packed"]).abs()[resp]
    out.update(logp_diff_max=float(diff.max()), logp_diff_mean=float(diff.mean()),
               packed_speedup=out["padded"]["step_s"]["median"] / out["packed"]["step_s"]["median"],
               path="THD (Transformer Engine)" if learner.uses_thd else "block-diagonal mask")
    out["checked"] = [f"packed rows ({out['path']}) against padded ones: log-probs and step time"]
    out["not_checked"] = [] if learner.uses_thd else [
        "THD attention through Transformer Engine (not installed: the block-diagonal mask ran, "
        "the CPU tests' path)"]
    return out


def engine_section(path: Path, state: dict, args) -> dict:
    from mugrpo_megatron.engines import SamplingSpec, make_engine
    from mugrpo_megatron.learner.export import iter_hf_tensors
    from mugrpo_megatron.phase.batches import logprob_gap, padded_batch

    learner, cfg = state["learner"], state["cfg"]
    out = {}
    learner.offload()
    t0 = time.perf_counter()
    engine = make_engine(cfg.rollout, path, dtype=cfg.model.dtype, max_model_len=args.seq + 64)
    out["start_s"] = time.perf_counter() - t0
    learner.onload()
    try:
        t0 = time.perf_counter()
        stats = engine.update_weights(iter_hf_tensors(learner.chunks(), learner.spec,
                                                      bucket_bytes=256 << 20))
        out["sync"] = {"seconds": time.perf_counter() - t0, "gb_s": stats.gb_per_s,
                       "tensors": stats.num_tensors}
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, learner.spec.vocab_size, (args.seq // 4,), generator=g).tolist()
                   for _ in range(args.prompts)]
        spec = SamplingSpec(n=args.group, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
        engine.generate(prompts[:2], SamplingSpec(n=1, max_new_tokens=4))  # warm-up
        t0 = time.perf_counter()
        gens = engine.generate(prompts, spec)
        seconds = time.perf_counter() - t0
        n_tok = sum(len(x.token_ids) for group in gens for x in group)
        out["generate"] = {"seconds": seconds, "tokens": n_tok, "tokens_per_s": n_tok / seconds,
                           "prompts": len(prompts), "group_size": args.group}

        def gap_of(gens) -> dict:
            """The learner's log-probs of each prompt's first sample against the engine's."""
            rows = [(prompts[i], x.token_ids, x.logprobs)
                    for i, group in enumerate(gens) for x in group[:1]][:args.samples]
            rows = rows[:len(rows) - len(rows) % args.micro] or rows[:1]
            batch = padded_batch(rows, [0.0] * len(rows))
            gap = logprob_gap(learner.logprobs(batch)[0], batch)
            return {"mean": gap.mean, "max": gap.max, "tokens": gap.num_tokens}

        out["logprob_gap"] = {"dtype": cfg.model.dtype, **gap_of(gens)}
        if engine.supports_sleep:
            t0 = time.perf_counter()
            engine.sleep()
            out["sleep_s"] = time.perf_counter() - t0
            if torch.cuda.is_available():
                out["free_gib_while_asleep"] = torch.cuda.mem_get_info()[0] / 2**30
            t0 = time.perf_counter()
            engine.wake(weights_only=True)  # as the trainer does: weights for the sync first
            out["wake_weights_s"] = time.perf_counter() - t0
            # level 2 dropped the weights: the sync after every sleep writes them again
            t0 = time.perf_counter()
            engine.update_weights(iter_hf_tensors(learner.chunks(), learner.spec,
                                                  bucket_bytes=256 << 20))
            out["resync_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.wake()
            out["wake_s"] = time.perf_counter() - t0
            # after the sleep and the resync the engine's samples still match the learner
            again = engine.generate(prompts[:args.micro], SamplingSpec(n=1, max_new_tokens=16))
            out["logprob_gap_after_wake"] = gap_of(again)
        else:
            out["sleep"] = "not supported here (no GPU)"
        engine.sleep()
        out["checked"] = ["vLLM's start with the learner offloaded, a weight sync, generation, "
                          "the train/inference gap" + (", sleep at level 2 and wake, the gap "
                                                       "after a resync" if engine.supports_sleep
                                                       else "")]
        out["not_checked"] = ["several engine replicas and engine TP > 1 (one GPU)"]
    except BaseException:
        engine.shutdown()
        raise
    state["engine_obj"] = engine  # the transitions section drives it; main shuts it down
    return out


def run_section(name: str, fn, results: dict) -> None:
    """Run one section; its record says what it checked and what it could not (a skipped or
    failed section checked nothing: why is its not-checked)."""
    t0 = time.perf_counter()
    try:
        value = fn()
        results[name] = {"status": "ok", **value}
    except _Skip as e:
        results[name] = {"status": "skipped", "why": str(e), "checked": [],
                         "not_checked": [f"all of it: {e}"]}
    except Exception as e:  # noqa: BLE001 - recorded, and the other sections still run
        results[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-3000:], "checked": [],
                         "not_checked": [f"all of it: it failed ({type(e).__name__})"]}
    results[name]["wall_s"] = time.perf_counter() - t0
    r = results[name]
    print(f"[device_check] {name}: {r['status']} ({r['wall_s']:.1f}s)", flush=True)
    for line in r.get("checked", []):
        print(f"    checked: {line}", flush=True)
    for line in r.get("not_checked", []):
        print(f"    not checked: {line}", flush=True)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "(not installed)"


class _Skip(Exception):
    pass


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Skip(f"{module} is not importable on this machine")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="1b" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--samples", type=int, default=None, help="responses per update")
    ap.add_argument("--micro", type=int, default=None, help="microbatch size")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--sections", default="te_specs,ceiling,learner_bf16,offload,reshard,packing,engine,"
                                          "transitions,checkpoint,learner_fp8,fp8_odd_lengths,"
                                          "fp8_amax_per_microbatch,moe_grouped")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    big = args.size != "tiny"
    args.samples = args.samples or (32 if big else 4)
    args.micro = args.micro or (4 if big else 2)
    args.seq = args.seq or (1024 if big else 64)
    args.prompts = args.prompts or (64 if big else 4)
    args.new_tokens = args.new_tokens or (256 if big else 16)
    sections = args.sections.split(",")
    results: dict = {"size": args.size, "args": vars(args)}
    state: dict = {}
    if "te_specs" in sections:  # first: what reading missed shows in the first GPU minute
        from device_specs import te_specs

        run_section("te_specs", lambda: te_specs(_Skip), results)
    path = make_model(args.size)
    if "ceiling" in sections:
        run_section("ceiling", lambda: ceiling(args), results)
        state["ceiling"] = results["ceiling"] if results["ceiling"]["status"] == "ok" else None
    if "learner_bf16" in sections:
        run_section("learner_bf16", lambda: learner_section(path, args, False, state), results)
    have_learner = "learner" in state
    for name, fn in (("offload", lambda: offload_section(state)),
                     ("reshard", lambda: reshard_section(state, args)),
                     ("packing", lambda: packing_section(state, args))):
        if name in sections:
            run_section(name, fn if have_learner else _no_learner, results)

    def engine():
        need("vllm")
        if not have_learner:
            _no_learner()
        return engine_section(path, state, args)

    if "engine" in sections:
        run_section("engine", engine, results)
    for name, fn in (("transitions", lambda: transitions_section(path, state, args)),
                     ("checkpoint", lambda: checkpoint_section(state))):
        if name in sections:
            run_section(name, fn if have_learner else _no_learner, results)
    if state.get("engine_obj") is not None:
        state.pop("engine_obj").shutdown()

    def fp8():
        if not torch.cuda.is_available():
            raise _Skip("FP8 needs a GPU")
        need("transformer_engine")
        state.pop("learner", None)
        gc.collect()
        torch.cuda.empty_cache()
        return learner_section(path, args, True, state)

    if "learner_fp8" in sections:
        run_section("learner_fp8", fp8, results)

    def odd():
        if results.get("learner_fp8", {}).get("status") != "ok":
            raise _Skip("the FP8 learner did not run (" + results.get("learner_fp8", {}).get(
                "why", results.get("learner_fp8", {}).get("error", "not asked for")) + ")")
        return fp8_odd_lengths(state, args)

    if "fp8_odd_lengths" in sections:
        run_section("fp8_odd_lengths", odd, results)

    def amax():
        if results.get("learner_fp8", {}).get("status") != "ok":
            raise _Skip("the FP8 learner did not run")
        return fp8_amax_per_microbatch(state, args)

    if "fp8_amax_per_microbatch" in sections:
        run_section("fp8_amax_per_microbatch", amax, results)
    if "moe_grouped" in sections:
        from device_moe import moe_grouped

        run_section("moe_grouped", lambda: moe_grouped(args, _Skip), results)
    rows = [[k, v["status"], _headline(k, v)] for k, v in results.items() if isinstance(v, dict)
            and "status" in v]
    print(table(["section", "status", "numbers"], rows))
    missing = [(k, line) for k, v in results.items() if isinstance(v, dict)
               for line in v.get("not_checked", [])]
    print("\nwhat this run could not check:" if missing else "\nevery section checked all of it")
    for name, line in missing:
        print(f"  {name}: {line}")
    write_json(args.out, results)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _no_learner():
    raise _Skip("the learner section did not run")


def _headline(name: str, v: dict) -> str:
    if v["status"] != "ok":
        return v.get("why") or v.get("error", "")[:100]
    if name == "ceiling":
        return (f"matmul {v['matmul_tflops']:.1f} TFLOP/s, H2D {v['h2d_gb_s']:.1f} GB/s, "
                f"D2H {v['d2h_gb_s']:.1f} GB/s")
    if name.startswith("learner"):
        return (f"{v['tokens_per_s']:.0f} tok/s, {v['model_tflops']:.1f} TFLOP/s, MFU "
                f"{v['mfu_vs_datasheet']:.1%} of datasheet")
    if name == "offload":
        return (f"{v['offload_1']['gib']:.2f} GiB off in {v['offload_1']['seconds']:.2f}s, "
                f"on in {v['onload_1']['seconds']:.2f}s")
    if name == "reshard":
        return f"{v['reshard_gb_s']:.2f} GB/s ({v['reshard_vs_copy']:.0%} of a D2H copy)"
    if name == "packing":
        return (f"{v['path']}: |logp diff| max {v['logp_diff_max']:.2e}, step {v['packed_speedup']:.2f}x "
                f"faster packed ({v['padding_frac']:.0%} padding)")
    if name == "transitions":
        return ", ".join(f"{m['transition']}{m['phase']} {m['used_gib']:.1f}/{m['estimate_gib']:.1f}"
                         for m in v["marks"] if "used_gib" in m) or "no device memory on CPU"
    if name == "checkpoint":
        return (f"save {v['save_s']:.2f}s (+{v['host_extra_gib']:.2f} GiB host, own optimizer "
                f"shard {v['own_optimizer_shard_gib']:.2f}), load {v['load_s']:.2f}s, "
                f"bit-exact {v['weights_bit_exact']}")
    if name == "fp8_odd_lengths":
        return f"seq {v['seq']} padded to a multiple of {v['token_multiple']}: loss {v['loss']:.4f}"
    if name == "fp8_amax_per_microbatch":
        return (f"amax reductions a microbatch: {v['forward_per_microbatch']:g} forward, "
                f"{v['backward_per_microbatch']:g} backward, at 1, 2 and 4 microbatches")
    if name == "engine":
        return (f"{v['generate']['tokens_per_s']:.0f} tok/s, sync {v['sync']['gb_s']:.2f} GB/s, "
                f"gap {v['logprob_gap']['mean']:.2e} (max {v['logprob_gap']['max']:.2e})"
                + (f", sleep {v['sleep_s']:.2f}s wake {v['wake_s']:.2f}s" if "sleep_s" in v else ""))
    return ""


if __name__ == "__main__":
    main()

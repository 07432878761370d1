"""Learner throughput and weight-sync speed for one layout (run under torchrun).

For each model size: tokens/s of a train step, the time to reshard the learner's shards into full
HF tensors (gather only), the time of a full sync into vLLM (reshard + engine load), and a plain
memory copy of the same bytes measured in the same run; medians of --repeats.

    torchrun --nproc_per_node 2 benchmarks/learner_and_sync.py --tp 2 --sizes h512 --out r.json
    torchrun --nproc_per_node 2 benchmarks/learner_and_sync.py --tp 2 --engine-tp 2 --out r.json

With ``--engine-tp`` equal to ``--tp`` (vLLM spmd: each rank an engine TP rank, as the 7B and 70B
configs run) the trainer's sync streams each rank its own shards (``handoff.sync_engine_tp``);
the run then times both streams into the same engine, interleaved: the full tensors (every TP
gather, as before) and each rank's shards (the bytes each rank then moves are counted by
tests/test_collectives.py). GB/s are of the model's bytes either way.

One model size per process: vLLM's shutdown tears down process-group state that a second
learner in the same process would need.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import random_batch, summarize, table, write_json  # noqa: E402

from mugrpo_megatron.config.loader import load_config  # noqa: E402
from mugrpo_megatron.engines.fleet import EngineFleet  # noqa: E402
from mugrpo_megatron.handoff import sync_engine_tp  # noqa: E402
from mugrpo_megatron.learner.export import iter_hf_tensors  # noqa: E402
from mugrpo_megatron.learner.learner import Learner  # noqa: E402
from mugrpo_megatron.models.tiny import make_tiny_checkpoint  # noqa: E402

SIZES = {"h256": dict(hidden_size=256, ffn_hidden_size=704, num_heads=4, num_kv_heads=2),
         "h512": dict(hidden_size=512, ffn_hidden_size=1408, num_heads=8, num_kv_heads=4),
         "h1024": dict(hidden_size=1024, ffn_hidden_size=2816, num_heads=16, num_kv_heads=4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--engine-tp", type=int, default=1,
                    help="the engine's TP size (rollout.tensor_parallel); = --tp: shards only")
    ap.add_argument("--sizes", default="h512", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tmp = Path(tempfile.gettempdir()) / "mugrpo_bench_models"
    rows, results = [], {}
    for name in args.sizes.split(","):
        path = tmp / f"{name}_l{args.layers}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            if not (path / "config.json").exists():
                make_tiny_checkpoint(path, "llama", num_layers=args.layers, vocab_size=4096,
                                     **SIZES[name])
        if dist.is_initialized():
            dist.barrier()
        cfg = load_config(None, [f"model.path={path}", "model.dtype=float32",
                                 f"parallel.tensor={args.tp}", f"parallel.pipeline={args.pp}",
                                 "parallel.micro_batch_size=8", "parallel.distributed_optimizer=false",
                                 "algo.samples_per_update=32", "algo.total_updates=8",
                                 "algo.updates_per_phase=4", "optim.lr=1e-5",
                                 f"rollout.tensor_parallel={args.engine_tp}"])
        learner = Learner.from_config(cfg)
        engine_tp = sync_engine_tp(cfg.rollout, learner)
        sharded = engine_tp > 0
        bucket = cfg.rollout.weight_bucket_mb << 20
        engines = EngineFleet.start(cfg.rollout, path, dtype="float32", max_model_len=256)
        batch = random_batch(32, 32, 96, 4000)
        learner.train_step(batch)  # warm-up
        step_s, reshard_s, sync_s, copy_s, sharded_s = [], [], [], [], []
        nbytes = sum(t.numel() * t.element_size() for _, t in
                     iter_hf_tensors(learner.chunks(), learner.spec))
        # the reference copy: the same bytes between two buffers that are already paged in, as
        # the engine's weights are
        src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        for _ in range(args.repeats):
            step_s.append(learner.train_step(batch).seconds)
            t0 = time.perf_counter()
            for _ in iter_hf_tensors(learner.chunks(), learner.spec):
                pass
            reshard_s.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            engines.update_weights(iter_hf_tensors(learner.chunks(), learner.spec,
                                                   bucket_bytes=bucket))  # raises
            sync_s.append(time.perf_counter() - t0)
            if sharded:
                dist.barrier()
                t0 = time.perf_counter()
                engines.update_weights(iter_hf_tensors(learner.chunks(), learner.spec,
                                                       bucket_bytes=bucket, engine_tp=engine_tp))
                sharded_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            copy_s.append(time.perf_counter() - t0)
        tokens = int(batch.response_mask.sum())
        res = {"params": learner.spec.num_parameters(), "bytes": nbytes,
               "step_s": summarize(step_s), "tokens_per_s": tokens / summarize(step_s)["median"],
               "reshard_s": summarize(reshard_s), "sync_s": summarize(sync_s),
               "memcpy_s": summarize(copy_s)}
        res["sync_gb_s"] = nbytes / 1e9 / res["sync_s"]["median"]
        res["reshard_gb_s"] = nbytes / 1e9 / res["reshard_s"]["median"]
        res["memcpy_gb_s"] = nbytes / 1e9 / res["memcpy_s"]["median"]
        res["engine_sharded"] = sharded
        sharded_gb_s = float("nan")
        if sharded:
            res["sync_sharded_s"] = summarize(sharded_s)
            sharded_gb_s = res["sync_sharded_gb_s"] = nbytes / 1e9 / res["sync_sharded_s"]["median"]
        results[name] = res
        rows.append([name, f"{res['params'] / 1e6:.1f}M", f"{nbytes / 1e6:.0f}MB",
                     res["tokens_per_s"], res["reshard_gb_s"], res["sync_gb_s"], sharded_gb_s,
                     res["memcpy_gb_s"], res["sync_gb_s"] / res["memcpy_gb_s"],
                     sharded_gb_s / res["memcpy_gb_s"]])
    if dist.get_rank() == 0:
        print(f"layout TP{args.tp} PP{args.pp} (world {dist.get_world_size()}), engine TP "
              f"{args.engine_tp}")
        print(table(["model", "params", "fp32 bytes", "train tok/s", "reshard GB/s", "sync GB/s",
                     "sharded sync GB/s", "memcpy GB/s", "sync/memcpy", "sharded/memcpy"], rows))
        write_json(args.out, {"layout": {"tp": args.tp, "pp": args.pp,
                                         "engine_tp": args.engine_tp}, "results": results})
    dist.barrier()
    engines.shutdown()


if __name__ == "__main__":
    main()

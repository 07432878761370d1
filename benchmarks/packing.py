"""Learner tokens spent on padding, padded against packed, at the 70B config's shape; and the CPU
time of an update both ways for a small model.

1. **Tokens per update** (arithmetic on the learner's own microbatching, no model): a phase's
   lengths drawn from a heavy-tailed distribution like long reasoning runs (prompts lognormal
   around ``--prompt-median``; responses lognormal around ``--response-median`` with sigma
   ``--sigma``, cut at ``rollout.max_new_tokens``: a mean near 1,200 tokens with ~6% at the cap
   of 3,072), split into updates as the 70B config does (``algo.samples_per_update`` 256 over DP
   2, micro-batch 1; every row padded to a multiple of 16 x TP8 = 128 tokens for FP8 with
   sequence parallel). Three ways:

   - **padded** (``parallel.pack_tokens: 0``): the trainer reads a rank's rows padded to their
     longest, and every microbatch carries that length (a pipeline needs one shape);
   - **padded per microbatch**: each microbatch cut to its own longest, for reference (megatron
     can do that only with ``variable_seq_lengths``, which costs a shape exchange per message);
   - **packed** (``auto`` on a GPU): first-fit rows of micro-batch x (max prompt + max response)
     = 4,096 tokens, as ``Learner._packed_microbatches`` plans them (``packing.plan_bins``).

   Reported: learner tokens an update (summed over DP ranks), the padded fraction, and the
   microbatches a rank runs. Then the same packed **under context parallelism** (``--cp``):
   each sequence starts at a multiple of 2 x CP (Transformer Engine's THD rule,
   ``packing.thd_partition``) and rows are a multiple of 2 x CP x the row multiple, against
   padded rows at that CP (each row a multiple of the same): the padding the rule adds.

2. **CPU time of an update** (``--cpu``, on by default): the real ``Learner`` at world size 1 on a
   small Llama (hidden 256, 4 layers), a batch of 32 sequences drawn from the same distribution
   scaled to a longest sequence of 512, micro-batch 1, ``train_step`` padded and packed (rows of
   512: megatron's local attention with a block-diagonal 512 x 512 mask, whose cost for the
   cross-sequence blocks it computes and masks out is what limits the gain on CPU; TE's THD
   attention on a GPU computes no such block).

    python benchmarks/packing.py [--updates 64] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import summarize, table, write_json  # noqa: E402

from mugrpo_megatron.layout import round_up  # noqa: E402
from mugrpo_megatron.learner.packing import plan_bins, slot  # noqa: E402


def draw_lengths(rng, n: int, args, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and response lengths of ``n`` sequences (``scale`` shrinks every length)."""
    cap_p, cap_r = int(args.max_prompt * scale), int(args.max_response * scale)
    prompt = np.clip(rng.lognormal(np.log(args.prompt_median * scale), 0.5, n), 8 * scale, cap_p)
    response = np.clip(rng.lognormal(np.log(args.response_median * scale), args.sigma, n), 1,
                       cap_r)
    return prompt.astype(int), response.astype(int)


def tokens_per_update(lengths: np.ndarray, dp: int, micro: int, multiple: int, capacity: int,
                      align: int = 1) -> dict[str, float]:
    """Learner tokens of one update of ``lengths`` (prompt + response of each row) three ways;
    packed sequences start at multiples of ``align`` (2 x CP)."""
    real = int(lengths.sum())
    padded = per_mb = packed = 0
    microbatches = {"padded": 0, "packed": 0}
    for share in np.split(lengths, dp):  # Learner.dp_rows: contiguous, even shares
        longest = round_up(int(share.max()), multiple)
        padded += longest * len(share)
        for lo in range(0, len(share), micro):
            per_mb += round_up(int(share[lo:lo + micro].max()), multiple) * len(share[lo:lo + micro])
        bins = plan_bins([slot(n, align) for n in share.tolist()], capacity)
        packed += len(bins) * capacity
        microbatches["padded"] = max(microbatches["padded"], -(-len(share) // micro))
        microbatches["packed"] = max(microbatches["packed"], len(bins))
    return {"real": real, "padded": padded, "padded_per_microbatch": per_mb, "packed": packed,
            "microbatches_padded": microbatches["padded"],
            "microbatches_packed": microbatches["packed"]}


def token_table(args) -> dict:
    rng = np.random.default_rng(args.seed)
    multiple = 16 * args.tp  # FP8 (delayed): 16 tokens a TP rank, sequence parallel
    capacity = round_up(args.micro * (args.max_prompt + args.max_response), multiple)
    rows = [tokens_per_update(p + r, args.dp, args.micro, multiple, capacity)
            for p, r in (draw_lengths(rng, args.samples_per_update, args)
                         for _ in range(args.updates))]
    total = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    p, r = draw_lengths(np.random.default_rng(args.seed), 100_000, args)
    total.update(response_mean=float(r.mean()), response_median=float(np.median(r)),
                 at_cap=float((r >= args.max_response).mean()), prompt_mean=float(p.mean()),
                 capacity=capacity, multiple=multiple)
    return total


def cp_table(args) -> dict:
    """Packed and padded tokens an update at each context-parallel size of ``--cp`` (the same
    lengths as ``token_table``): rows a multiple of 16 x TP x 2 CP, packed sequences at
    multiples of 2 CP."""
    out = {}
    for cp in args.cp:
        rng = np.random.default_rng(args.seed)
        multiple = 16 * args.tp * 2 * cp
        capacity = round_up(args.micro * (args.max_prompt + args.max_response), multiple)
        rows = [tokens_per_update(p + r, args.dp, args.micro, multiple, capacity, 2 * cp)
                for p, r in (draw_lengths(rng, args.samples_per_update, args)
                             for _ in range(args.updates))]
        t = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        t["capacity"] = capacity
        out[cp] = t
    return out


def cpu_update_times(args) -> dict:
    """train_step on CPU, padded and packed, the same batch and weights."""
    import torch

    torch.set_num_threads(args.threads)
    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.learner.learner import Learner
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint
    from mugrpo_megatron.phase.batches import padded_batch

    scale = args.cpu_longest / (args.max_prompt + args.max_response)
    rng = np.random.default_rng(args.seed + 1)
    prompt, response = draw_lengths(rng, args.cpu_batch, args, scale)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_checkpoint(Path(tmp) / "m", "llama", hidden_size=256, ffn_hidden_size=704,
                                  num_heads=4, num_kv_heads=2, vocab_size=4096, num_layers=4,
                                  max_position_embeddings=args.cpu_longest)
        cfg = load_config(None, [
            f"model.path={hf}", "model.dtype=float32", "parallel.micro_batch_size=1",
            f"algo.samples_per_update={args.cpu_batch}", "algo.total_updates=64",
            "algo.updates_per_phase=64", "optim.lr=1e-5", "parallel.pack_tokens=0",
            f"data.max_prompt_tokens={int(args.max_prompt * scale)}",
            f"rollout.max_new_tokens={args.cpu_longest - int(args.max_prompt * scale)}"])
        learner = Learner.from_config(cfg)
        gen = np.random.default_rng(3)
        rows = [(gen.integers(5, 4000, int(p)), gen.integers(5, 4000, int(r)),
                 -gen.random(int(r)).astype(np.float32)) for p, r in zip(prompt, response)]
        batch = padded_batch(rows, gen.standard_normal(len(rows)))
        out = {"sequences": len(rows), "real_tokens": int((prompt + response).sum()),
               "padded_tokens": int(batch.tokens.numel())}
        for name, capacity in (("padded", 0), ("packed", args.cpu_longest)):
            learner.pack_capacity = capacity
            learner.train_step(batch)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                learner.train_step(batch)
                times.append(time.perf_counter() - t0)
            out[name] = summarize(times)
        bins = plan_bins((prompt + response).tolist(), args.cpu_longest)
        out["packed_tokens"] = len(bins) * args.cpu_longest
        out["speedup"] = out["padded"]["median"] / out["packed"]["median"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=64)
    ap.add_argument("--samples-per-update", type=int, default=256)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-response", type=int, default=3072)
    ap.add_argument("--prompt-median", type=float, default=200)
    ap.add_argument("--response-median", type=float, default=900)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cp", type=int, nargs="*", default=[2, 4, 8],
                    help="context-parallel sizes for the packed-under-CP table")
    ap.add_argument("--no-cpu", dest="cpu", action="store_false")
    ap.add_argument("--cpu-batch", type=int, default=32)
    ap.add_argument("--cpu-longest", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "packing.json"))
    ap.add_argument("--quick", action="store_true", help="8 updates; CPU: 8 sequences of <= 128")
    args = ap.parse_args()
    if args.quick:  # one thread: in the suite it runs beside another test file
        args.updates, args.cpu_batch, args.cpu_longest, args.repeats = 8, 8, 128, 1
        args.threads = 1
        args.out = str(Path(tempfile.gettempdir()) / "packing_quick.json")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    t = token_table(args)
    print(f"lengths: prompts mean {t['prompt_mean']:.0f}; responses mean {t['response_mean']:.0f}, "
          f"median {t['response_median']:.0f}, {t['at_cap']:.1%} at the cap {args.max_response}; "
          f"{args.samples_per_update} sequences an update over DP {args.dp}, micro-batch "
          f"{args.micro}, rows to a multiple of {t['multiple']}, packed rows of {t['capacity']}")
    rows = [[name, f"{t[key]:,.0f}", f"{1 - t['real'] / t[key]:.1%}", mbs]
            for name, key, mbs in (
                ("real (no padding)", "real", "-"),
                ("padded (pack_tokens: 0)", "padded", f"{t['microbatches_padded']:.0f}"),
                ("padded per microbatch", "padded_per_microbatch",
                 f"{t['microbatches_padded']:.0f}"),
                ("packed (auto on GPU)", "packed", f"{t['microbatches_packed']:.1f}"))]
    print(table(["way", "learner tokens an update", "padding", "microbatches a rank"], rows))
    print(f"packed / padded tokens = {t['packed'] / t['padded']:.2f}")
    cps = cp_table(args)
    print(table(["context parallel", "packed row", "packed tokens", "padding", "padded tokens",
                 "padding"],
                [[f"CP{cp}", c["capacity"], f"{c['packed']:,.0f}", f"{1 - c['real'] / c['packed']:.1%}",
                  f"{c['padded']:,.0f}", f"{1 - c['real'] / c['padded']:.1%}"]
                 for cp, c in cps.items()]))
    result = {"args": vars(args), "tokens": t, "context_parallel": cps}
    if args.cpu:
        c = cpu_update_times(args)
        print(table(["CPU update (h256, 4 layers, world 1)", "tokens", "seconds (median)"], [
            ["padded", c["padded_tokens"], c["padded"]["median"]],
            ["packed (block-diagonal mask)", c["packed_tokens"], c["packed"]["median"]]]))
        print(f"{c['sequences']} sequences, {c['real_tokens']} real tokens; packed is "
              f"{c['speedup']:.2f}x padded on CPU")
        result["cpu"] = c
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

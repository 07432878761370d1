"""Runs under torchrun: scaled-down copies of the shipped configs' layouts, each through a packed
update, a padded update, a scoring pass (packed and padded log-probs) and a weight sync's export
stream, with Transformer
Engine's per-microbatch FP8 amax reduction emulated over gloo; every rank records the collectives
it issues per process group (``collective_log``), and rank 0 writes them all.

python -m torch.distributed.run --nproc_per_node N tests/dist/collectives_worker.py HF_DIR JOBS

JOBS is a JSON file: a list of {"name", "hf_dir", "overrides": [KEY=VALUE, ...], "out"}. The
rows are dealt so that the data-parallel ranks hold very different lengths (rank 0 long
sequences, the last rank short ones): packed, their ranks make different numbers of bins, which
``Learner._equal_count`` must even out. The learner starts as one with FP8 delayed scaling does
(uncalibrated), so its first scoring pass calibrates first. Each OUT gets result.json: per step,
every rank's log, the amax reductions the emulation made, and the bins each rank packed before
evening out.
"""

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from collective_log import CollectiveLog, te_amax_emulation  # noqa: E402

from mugrpo_megatron.config.loader import load_config  # noqa: E402
from mugrpo_megatron.handoff import sync_engine_tp  # noqa: E402
from mugrpo_megatron.learner.export import iter_hf_tensors  # noqa: E402
from mugrpo_megatron.types import Shard  # noqa: E402
from mugrpo_megatron.learner.learner import Learner  # noqa: E402
from mugrpo_megatron.learner.packing import plan_bins, sequence_lengths  # noqa: E402
from mugrpo_megatron.types import TokenBatch, TrainBatch  # noqa: E402


def rows_for(rank: int, ranks: int, n: int, vocab: int, seed: int) -> TrainBatch:
    """``n`` rows for data-parallel rank ``rank`` of ``ranks``: the first rank's about 3x as
    long as the last's, with responses of varied lengths and wide behaviour log-probs."""
    g = torch.Generator().manual_seed(seed + rank)
    longest = 30 - 20 * rank // max(ranks - 1, 1)
    seq = 32
    tokens = torch.zeros(n, seq, dtype=torch.long)
    resp = torch.zeros(n, seq, dtype=torch.bool)
    for b in range(n):
        length = int(torch.randint(max(4, longest // 2), longest + 1, (1,), generator=g))
        tokens[b, :length] = torch.randint(3, vocab, (length,), generator=g)
        resp[b, 3:length] = True
    behav = torch.where(resp, torch.rand(n, seq, generator=g) * 6 - 5, torch.zeros(n, seq))
    return TrainBatch(tokens, resp, behav, torch.randn(n, generator=g))


def gathered(log) -> list:
    """Every rank's log, in rank order, on every rank (one object all-gather, outside the log)."""
    mine = {"calls": log.calls, "p2p": log.p2p, "p2p_groups": sorted(log.p2p_groups),
            "batched_peers": sorted(log.batched_peers)}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def run_job(job: dict) -> None:
    cfg = load_config(None, [f"model.path={job['hf_dir']}", "model.dtype=float32",
                             *job["overrides"]])
    learner = Learner.from_config(cfg)
    layout = learner.layout
    per_rank = cfg.algo.samples_per_update // layout.dp_size
    mine = rows_for(layout.dp_rank, layout.dp_size, per_rank, learner.spec.vocab_size, seed=3)
    whole = [rows_for(r, layout.dp_size, per_rank, learner.spec.vocab_size, seed=3)
             for r in range(layout.dp_size)]
    scoring = TokenBatch(torch.cat([b.tokens for b in whole]),
                         torch.cat([b.response_mask for b in whole]))
    capacity = learner.pack_capacity
    bins = len(plan_bins(sequence_lengths(mine.response_mask), capacity)) if capacity else 0
    result = {"steps": {}, "bins": None}
    # as a learner with FP8 delayed scaling starts: its no-grad passes before the first update
    # first run one grad-enabled forward (Learner._calibrate_fp8), which TE's amax reduction sees
    learner._fp8_uncalibrated = True
    steps = {"score_packed": lambda: learner.logprobs(scoring),
             "score_padded": lambda: learner.logprobs(scoring, packed=False),
             "update_packed": lambda: learner.train_step(mine, dp_local=True),
             "update_padded": lambda: padded_update(learner, mine),
             # a weight sync's stream (every rank receives every HF tensor), and the same for an
             # engine at the learner's TP ranks (each rank streams its own shards)
             "export": lambda: streamed(learner, 0),
             "export_sharded": lambda: streamed(learner, layout.tp_size)}
    # and for an engine replica over k learner TP groups (the configured engine TP, a multiple
    # of the learner's): each rank's engine slices from the ranks that hold them
    engine_tp = sync_engine_tp(cfg.rollout, learner)
    if engine_tp > layout.tp_size:
        steps["export_targeted"] = lambda: streamed(learner, engine_tp)
    for name, step in steps.items():
        with te_amax_emulation(learner) as amax, CollectiveLog() as log:
            out = step()
        if name.startswith("update"):
            assert not out.skipped, (name, out.reason)
        if name.startswith("export"):
            assert out
            result.setdefault("streams", {})[name] = out
            out = None
        result["steps"][name] = {"logs": gathered(log), "amax": amax}
    streams = result.pop("streams")
    full, sharded = streams["export"], streams["export_sharded"]
    result["sharded_as_engine_keeps"] = same_engine_slices(
        full, sharded, layout.tp_rank, layout.tp_size, learner.spec)
    rank = torch.distributed.get_rank()
    result["engine_tp"] = engine_tp
    if "export_targeted" in streams:
        result["targeted_as_engine_keeps"] = same_engine_slices(
            full, streams["export_targeted"], rank % engine_tp, engine_tp, learner.spec)
    result["kept_bytes"] = kept_bytes(full, layout.tp_size)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, bins)
    result["bins"] = every
    if torch.distributed.get_rank() == 0:
        Path(job["out"]).write_text(json.dumps(result))
    torch.distributed.barrier()


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROWS = ("o_proj", "down_proj")  # split along their input (dim 1); the others along dim 0


def streamed(learner, engine_tp: int) -> dict:
    """The weight-sync stream's tensors on this rank, by name (``engine_tp`` 0: every tensor
    whole)."""
    return {n: t.whole() if isinstance(t, Shard) else t.clone()
            for n, t in iter_hf_tensors(learner.chunks(), learner.spec, bucket_bytes=1 << 16,
                                        engine_tp=engine_tp if engine_tp > 1 else 0)}


def engine_slice(name: str, shape, tp_rank: int, tp: int, spec) -> tuple[slice, ...]:
    """What vLLM's TP rank ``tp_rank`` of ``tp`` loads of an HF projection: its equal part of the
    split dimension (heads, rows or input columns); with fewer KV heads than ranks, the KV head
    tp_rank // (tp / KV heads) (vLLM's QKVParallelLinear replicates each over as many ranks)."""
    dim = 1 if any(f".{r}." in name for r in ROWS) else 0
    n = shape[dim] // tp
    start = tp_rank * n
    kv = spec.num_kv_heads
    if (".k_proj." in name or ".v_proj." in name) and kv < tp:
        n = spec.head_dim
        start = tp_rank // (tp // kv) * n
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + n)
    return tuple(index)


def is_projection(name: str) -> bool:
    """An attention or MLP projection, an MoE expert's included (sliced by TP like a dense
    MLP's where the engine keeps experts by TP)."""
    return any(f".{p}." in name for p in PROJECTIONS)


def same_engine_slices(full: dict, sharded: dict, engine_rank: int, engine_tp: int, spec) -> bool:
    """The sharded stream's tensors hold exactly the full stream's values in this rank's engine
    slice of every projection (zeros elsewhere), and every other tensor bit for bit."""
    if set(full) != set(sharded):
        return False
    for name, f in full.items():
        s = sharded[name]
        if f.shape != s.shape or f.dtype != s.dtype:
            return False
        if not is_projection(name) or engine_tp == 1:
            if not torch.equal(f, s):
                return False
            continue
        index = engine_slice(name, f.shape, engine_rank, engine_tp, spec)
        rest = s.clone()
        rest[index] = 0
        if not torch.equal(s[index], f[index]) or rest.any():
            return False
    return True


def kept_bytes(full: dict, tp: int) -> dict:
    """Bytes of the stream's projections and of everything else (vocabulary, norms): an engine
    rank keeps 1/TP of the projections."""
    proj = sum(t.numel() * t.element_size() for n, t in full.items() if is_projection(n))
    rest = sum(t.numel() * t.element_size() for n, t in full.items() if not is_projection(n))
    return {"projections": proj, "other": rest, "tp": tp}


def padded_update(learner, batch):
    """The update with packing turned off for this call (the learner reads its capacity at each
    call)."""
    own = learner.pack_capacity
    learner.pack_capacity = 0
    try:
        return learner.train_step(batch, dp_local=True)
    finally:
        learner.pack_capacity = own


def main() -> None:
    from megatron.core import parallel_state as mpu

    for job in json.loads(Path(sys.argv[1]).read_text()):
        run_job(job)
        gc.collect()
        mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

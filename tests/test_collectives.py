"""Every member of every process group issues the same collectives in the same order, in every
layout the shipped configs use (scaled down to gloo ranks on CPU), packed and padded, in an
update and in a scoring pass: the rule whose breaking hangs a GPU job until its timeout.

Transformer Engine's per-microbatch FP8 amax all-reduce (over TP x DP, after every grad-enabled
forward and in every backward) is emulated (``collective_log.te_amax_emulation``); the learner
starts as an FP8 delayed-scaling one does, so that its first scoring pass runs one calibrating
grad-enabled forward (the no-grad passes before the first update otherwise quantize with TE's
initial scale of 1.0); and the
data-parallel ranks hold rows of very different lengths, so that packed they make different
numbers of bins. Before ``Learner._equal_count`` the 70B FP8 config would hang at its first update
this way (a rank with fewer microbatches in the gradient reduce-scatter, the others in an amax
all-reduce); here, with parallel.timeout_minutes = 1, that is a gloo timeout within a minute.
"""

import json

import pytest
from collective_log import bytes_moved, mismatches
from helpers import ROOT, torchrun

from mugrpo_megatron.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "dist" / "collectives_worker.py"
COMMON = ["parallel.micro_batch_size=2", "algo.samples_per_update=16", "algo.total_updates=4",
          "algo.updates_per_phase=4", "optim.lr=1e-3", "parallel.pack_tokens=64",
          "parallel.pad_tokens_to=16", "data.max_prompt_tokens=16", "rollout.max_new_tokens=16",
          "parallel.timeout_minutes=1"]
# ranks -> [(shipped config, tiny family, its layout scaled down)]
LAYOUTS = {
    2: [("qwen2.5-math-1.5b_8xh100 (DP8 -> DP2)", "llama",
         ["parallel.distributed_optimizer=true"])],
    4: [("qwen2.5-math-7b_8xh100 (TP2 SP x DP4 -> TP2 SP x DP2)", "qwen2",
         ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
        ("qwen3-30b-a3b_2x8xh100 (DP16 EP8 -> DP4 EP2)", "qwen3_moe",
         ["parallel.expert=2", "parallel.distributed_optimizer=true"])],
    8: [("llama-3.1-70b_8x8xh100_fp8 (TP8 SP x PP4 x DP2 -> TP2 SP x PP2 x DP2)", "llama",
         ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
          "parallel.distributed_optimizer=true"]),
        ("llama-3.1-70b_16x8xh100_32k (TP8 SP x PP4 x CP4 -> TP2 SP x PP2 x CP2)", "llama",
         ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
          "parallel.context=2", "parallel.pack_tokens=0"]),
        # Qwen3-235B-A22B's layout (TP4 SP x PP2 x DP16 with EP16 on 128 GPUs: README, MoE)
        ("qwen3-235b-a22b (TP4 SP x PP2 x EP16 -> TP2 SP x PP2 x DP2 EP2)", "qwen3_moe",
         ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
          "parallel.expert=2", "parallel.distributed_optimizer=true"])],
}
CASES = [(ranks, i) for ranks, jobs in LAYOUTS.items() for i in range(len(jobs))]


def engine_at_twice_the_tp(overrides: list[str]) -> list[str]:
    """vLLM spmd at twice the learner's TP (a replica over two learner TP groups, as Qwen3-235B's
    engine at TP16 beside its learner at TP4): the worker then also streams each rank its engine
    slices (``export_targeted``)."""
    tp = next((int(o.split("=")[1]) for o in overrides if o.startswith("parallel.tensor=")), 1)
    return ["rollout.placement=spmd", f"rollout.tensor_parallel={2 * tp}"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("collectives")
    out = {}
    for ranks, jobs in LAYOUTS.items():
        spec = []
        for i, (_, family, overrides) in enumerate(jobs):
            hf = d / family
            if not (hf / "config.json").exists():
                make_tiny_checkpoint(hf, family, seed=2)
            spec.append({"hf_dir": str(hf), "overrides": [*COMMON, *overrides,
                                                          *engine_at_twice_the_tp(overrides)],
                         "out": str(d / f"{ranks}_{i}.json")})
        (d / f"jobs_{ranks}.json").write_text(json.dumps(spec))
        torchrun(ranks, WORKER, str(d / f"jobs_{ranks}.json"), timeout=900)
        for i in range(len(jobs)):
            out[ranks, i] = json.loads((d / f"{ranks}_{i}.json").read_text())
    return out


@pytest.mark.parametrize("ranks, job", CASES, ids=[LAYOUTS[r][i][0].split(" ")[0]
                                                   for r, i in CASES])
def test_every_group_member_issues_the_same_collectives(results, ranks, job):
    got = results[ranks, job]
    assert set(got["steps"]) == {"update_packed", "update_padded", "score_packed",
                                 "score_padded", "export", "export_sharded", "export_targeted"}
    for step, r in got["steps"].items():
        assert mismatches(r["logs"]) == [], step
        calls = sum(len(c) for log in r["logs"] for c in log["calls"].values())
        assert calls > 0 or step.startswith("export"), step  # a DP-only export gathers nothing
        # the emulated FP8 amax reduction runs with grad on only, as TE's does: in updates, and
        # in the one calibrating forward of the first scoring pass before any update
        if step.startswith("update"):
            assert r["amax"]["forward"] > 0 and r["amax"]["backward"] > 0, (step, r["amax"])
        elif step == "score_packed":  # (export: no forward)
            assert r["amax"] == {"forward": 1, "backward": 0}, (step, r["amax"])
        else:
            assert r["amax"] == {"forward": 0, "backward": 0}, step
    # the data-parallel ranks packed different numbers of bins: the case that hung (context
    # parallel layouts pad: nothing to pack)
    _, _, overrides = LAYOUTS[ranks][job]
    if "parallel.pack_tokens=0" not in overrides:
        assert len(set(got["bins"])) > 1, got["bins"]


def test_the_guard_sees_a_rank_that_skips_a_collective():
    """``mismatches`` itself: a member that issued one collective fewer, or a send nobody
    received, is named (the check cannot pass vacuously)."""
    same = {"calls": {"g:0,1": [["all_reduce", [[[4], "float32"]]]]}, "p2p": {}}
    fewer = {"calls": {"g:0,1": []}, "p2p": {}}
    assert mismatches([same, same]) == []
    assert "rank 0 issued 1 collectives, rank 1 0" in mismatches([same, fewer])[0]
    sent = {"calls": {}, "p2p": {"1:send": [[[2], "float32"]]}}
    assert "sent 1 tensors to rank 1" in mismatches([sent, {"calls": {}, "p2p": {}}])[0]


@pytest.mark.parametrize("ranks, job", CASES, ids=[LAYOUTS[r][i][0].split(" ")[0]
                                                   for r, i in CASES])
def test_the_dry_run_counts_every_communicator_a_rank_uses(results, ranks, job):
    """NCCL allocates a communicator's buffers when it runs its first collective: one for every
    group a rank issues collectives on (megatron keeps several groups of the same ranks: DP and
    its context-parallel twin, TP x DP and its twin...) and one for each point-to-point peer.
    The dry run's count (dryrun.memory.communicators, with FP8 as the emulation has it) is at
    least what each rank of each scaled-down layout used in an update, a scoring pass and a
    weight sync's stream."""
    from dataclasses import replace

    from mugrpo_megatron.config.loader import load_config
    from mugrpo_megatron.dryrun.memory import communicators

    _, _, overrides = LAYOUTS[ranks][job]
    cfg = load_config(None, [*COMMON, *overrides, *engine_at_twice_the_tp(overrides)])
    cfg = replace(cfg, model=replace(cfg.model, dtype="bfloat16", fp8_format="hybrid"))
    counted = communicators(cfg, cfg.parallel.data_parallel(ranks))
    learner = sum(v for k, v in counted.items() if k != "engine")
    got = results[ranks, job]
    for rank in range(ranks):
        groups = {key for r in got["steps"].values() for key, calls in
                  r["logs"][rank]["calls"].items() if calls and "," in key.split(":")[1]}
        # batched point-to-point ops run on their group's communicator, others on one a peer
        groups |= {key for r in got["steps"].values() for key in r["logs"][rank]["p2p_groups"]
                   if "," in key.split(":")[1]}
        peers = {key.split(":")[0] for r in got["steps"].values() for key in r["logs"][rank]["p2p"]}
        peers -= {p for r in got["steps"].values() for p in r["logs"][rank]["batched_peers"]}
        assert len(groups) + len(peers) <= learner, (rank, sorted(groups), peers, counted)


@pytest.mark.parametrize("ranks, job", [(4, 0), (8, 0), (8, 1), (8, 2)],
                         ids=["qwen2.5-math-7b", "llama-3.1-70b", "llama-3.1-70b-32k-cp",
                              "qwen3-235b-a22b-moe"])
def test_a_sync_sends_each_rank_its_shards(results, ranks, job):
    """Where the engine's TP ranks are the learner's (the 7B and 70B configs: vLLM spmd at the
    learner's TP size; under context parallelism too, whose ranks hold the same weights as DP
    ranks do and feed their own engine ranks), a sync's stream skips the TP gathers of the attention and MLP
    projections and broadcasts shards over PP: every rank sends and receives about 1/TP of
    their bytes, plus the vocabulary and norms that travel whole; and each engine rank's slice
    of every tensor is bit for bit the full stream's (zeros elsewhere). An MoE's experts too
    (the scaled-down 235B layout): each rank gathers its TP slice of the other expert-parallel
    ranks' experts, not every expert whole. Bytes counted from the collectives each rank issued
    (``collective_log.bytes_moved``: NCCL's ring algorithms)."""
    got = results[ranks, job]
    assert got["sharded_as_engine_keeps"]
    kept = got["kept_bytes"]
    tp = kept["tp"]
    assert tp == 2 and kept["projections"] > 4 * kept["other"]  # what the test bites on
    for rank in range(ranks):
        full = bytes_moved(got["steps"]["export"]["logs"][rank], rank)
        mine = bytes_moved(got["steps"]["export_sharded"]["logs"][rank], rank)
        # at most its shard of every projection and every other tensor whole, each way
        bound = kept["projections"] / tp + kept["other"]
        assert mine[0] <= bound and mine[1] <= bound, (rank, mine, bound, kept)
        # the full stream moves (TP - 1) / TP of the projections more on every rank
        assert full[1] - mine[1] >= kept["projections"] * (tp - 1) / tp * 0.99, (rank, full, mine)
        print(f"rank {rank}: full stream sent {full[0]} B, received {full[1]} B; sharded sent "
              f"{mine[0]} B, received {mine[1]} B (projections {kept['projections']} B, other "
              f"{kept['other']} B, TP {tp})")


@pytest.mark.parametrize("ranks, job", CASES, ids=[LAYOUTS[r][i][0].split(" ")[0]
                                                   for r, i in CASES])
def test_a_sync_into_a_wider_engine_sends_each_rank_its_slices(results, ranks, job):
    """vLLM spmd at twice the learner's TP (issue 51: an engine replica over several learner TP
    groups, Qwen3-235B's and DeepSeek-V3's engines at TP16 beside learners at TP4 and TP8):
    each rank's stream holds exactly its engine rank's slice of every projection and expert
    (zeros elsewhere; a KV head kept by as many engine ranks as vLLM replicates it over), every
    other tensor bit for bit, and each rank receives at most 1/(engine TP) of the projections
    and experts plus the tensors that travel whole, where the stream without it sent every
    rank every tensor whole (the learner ranks that hold a slice send it point to point; bytes
    counted from the collectives each rank issued)."""
    got = results[ranks, job]
    kept = got["kept_bytes"]
    engine_tp = got["engine_tp"]
    assert engine_tp == 2 * kept["tp"], got["engine_tp"]
    assert got["targeted_as_engine_keeps"]
    bound = kept["projections"] / engine_tp + kept["other"]
    for rank in range(ranks):
        full = bytes_moved(got["steps"]["export"]["logs"][rank], rank)
        mine = bytes_moved(got["steps"]["export_targeted"]["logs"][rank], rank)
        assert mine[1] <= bound, (rank, mine, bound, kept)
        print(f"rank {rank}: full stream received {full[1]} B; the engine slices at engine TP "
              f"{engine_tp} {mine[1]} B (projections {kept['projections']} B, other "
              f"{kept['other']} B)")

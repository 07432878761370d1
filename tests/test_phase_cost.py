"""The phase-cost model (``dryrun.cost``) against hand computations on Qwen2.5-Math-1.5B on one
node of 8 H100 (and two, for the fabric): a decode step's reads and FLOPs, a phase's decode steps
in one wave and in many, the sync's link, and GRPO mu=4 beside Mu-GRPO doing the same work."""

import dataclasses

import pytest
from helpers import ROOT

from mugrpo_megatron.__main__ import main
from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.dryrun import cost
from mugrpo_megatron.dryrun.memory import EngineTensors, estimate
from mugrpo_megatron.models.hf_config import read_model_spec

CONFIG = ROOT / "configs" / "qwen2.5-math-1.5b_8xh100.yaml"
MODEL = ROOT / "configs" / "models" / "qwen2.5-math-1.5b.json"
SPEC = read_model_spec(MODEL)
# 1.5B: 28 layers, hidden 1536, 12 heads of 128, 2 KV heads, MLP 8960, vocab 151936 (tied)
H, LAYERS, HEADS, KV, HD, FFN, VOCAB = 1536, 28, 12, 2, 128, 8960, 151936


def test_a_decode_step_is_the_slower_of_its_reads_and_its_compute():
    cfg = load_config(CONFIG)
    rates = cost.Rates()
    weights = EngineTensors.of(SPEC, 1, "bfloat16").total
    kv_token = LAYERS * 2 * KV * HD * 2  # K and V of 2 heads a layer, bf16
    batch, context = 200, 1500
    memory = (weights + batch * context * kv_token) / (3.35e12 * 0.7)
    # a token's weight GEMMs (q, k, v, o; gate, up, down; the output layer), 2 FLOPs a MAC,
    # and its attention over the context (q.k and p.v, 2 FLOPs each a head dimension)
    per_token = 2 * (LAYERS * (H * (HEADS + 2 * KV) * HD + HEADS * HD * H + 3 * H * FFN)
                     + H * VOCAB) + 2 * LAYERS * context * HEADS * 2 * HD
    compute = batch * per_token / (989e12 * 0.5)
    got = cost.decode_step_seconds(SPEC, cfg, batch, context, rates, 1)
    assert got == pytest.approx(max(memory, compute) + 0.003, rel=1e-3)
    assert memory > compute  # decode reads more than it computes at this batch
    # a TP replica pays two all-reduces a layer; across nodes at the cross-node latency
    tp2 = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tensor_parallel=2))
    weights2 = EngineTensors.of(SPEC, 2, "bfloat16").total
    memory2 = (weights2 + batch * context * kv_token / 2) / (3.35e12 * 0.7)
    assert cost.decode_step_seconds(SPEC, tp2, batch, context, rates, 2) == pytest.approx(
        max(memory2, compute / 2) + 0.003 + 2 * LAYERS * 40e-6, rel=1e-3)


def phase(cfg, world=8, per_node=8, rates=None):
    return cost.phase_cost(cfg, SPEC, world, per_node, rates or cost.Rates())


def test_a_phase_of_few_responses_lasts_as_long_as_its_longest():
    """GRPO's phase (32 prompts x 8 = 256 responses over 8 replicas: 32 each, fewer than a
    replica runs at once) decodes max_new_tokens steps, its batch thinning as responses end; a
    phase of many decodes full batches, then drains to the longest."""
    rates = cost.Rates()
    few = cost.with_mu(load_config(CONFIG), 1)
    assert few.algo.prompts_per_phase == 32
    p = phase(few)
    mean, prompt = 0.5 * 3072, 0.25 * 1024
    context = prompt + mean / 2
    e = estimate(few, SPEC, 8, rates.gpu_gib, 8)
    concurrency = min(1024, int(e["kv_tokens"] // context))
    assert p.concurrency == concurrency > 32
    assert p.decode_steps == 3072
    step = cost.decode_step_seconds(SPEC, few, 32 * mean / 3072, context, rates, 1)
    gemm = 2 * (LAYERS * (H * (HEADS + 2 * KV) * HD + HEADS * HD * H + 3 * H * FFN) + H * VOCAB)
    prefill = 4 * prompt * gemm / (989e12 * 0.5)  # 4 prompts a replica, once a group
    assert p.generate == pytest.approx(3072 * step + prefill, rel=1e-6)

    many = load_config(CONFIG)  # 32768 prompts x 8: 32768 responses a replica
    m = phase(many)
    full = 32768 * mean / concurrency
    assert m.decode_steps == pytest.approx(full + (3072 - mean))
    step = cost.decode_step_seconds(SPEC, many, concurrency, context, rates, 1)
    drain = (3072 - mean) * cost.decode_step_seconds(SPEC, many, concurrency / 2, context,
                                                     rates, 1)
    assert m.generate == pytest.approx(full * step + drain + 4096 * prompt * gemm
                                       / (989e12 * 0.5), rel=1e-6)


def test_the_sync_crosses_the_fabric_only_where_the_stream_does():
    kept = ["parallel.offload_learner=never"]
    cfg = load_config(CONFIG, kept)
    e = estimate(cfg, SPEC, 8, ranks_per_node=8)
    assert phase(cfg).sync == pytest.approx(e["sync_bytes"] / 360e9)  # one node: NVLink
    assert phase(cfg).switch == pytest.approx(2 * e["host_engine"] / 50e9 + 2.0)
    two = load_config(CONFIG, kept + ["parallel.pipeline=2"])  # stages on two nodes
    e2 = estimate(two, SPEC, 8, ranks_per_node=8)
    assert phase(two, world=16).sync == pytest.approx(e2["sync_bytes"] / 40e9)
    off = load_config(CONFIG)  # 'auto': offloaded on a GPU
    e3 = estimate(off, SPEC, 8, ranks_per_node=8)
    assert e3["offloaded"]
    p = phase(off)  # the offloaded learner's shard read from its host copy too
    assert p.sync == pytest.approx(e3["sync_bytes"] / 360e9 + e3["params"] / 50e9)
    assert p.switch == pytest.approx((2 * (e3["params"] + e3["optimizer"])
                                      + 2 * e3["host_engine"]) / 50e9 + 2.0)


def test_grpo_and_mu_grpo_do_the_same_work_and_differ_in_what_a_phase_costs():
    cfg = load_config(CONFIG)
    grpo, mu = cost.compare(cfg, SPEC, 8, 8)
    assert (grpo.mu, grpo.phases, grpo.responses_per_phase) == (4, 1024, 4 * 256)
    assert (mu.mu, mu.phases, mu.responses_per_phase) == (1024, 4, 1024 * 256)
    assert grpo.term("learner") == pytest.approx(mu.term("learner"))  # the same updates
    assert grpo.term("sync") == pytest.approx(1024 * mu.phase.sync)  # a sync a phase
    assert grpo.seconds > mu.seconds
    low, high = cost.ratio_range(cfg, SPEC, 8, 8)
    assert low < grpo.seconds / mu.seconds < high
    # a GRPO config compares with the paper's mu, at most its updates
    g = load_config(CONFIG, ["algo.updates_per_phase=4", "algo.prompts_per_phase=128"])
    assert cost.compare(g, SPEC, 8, 8)[1].mu == 1024
    short = load_config(CONFIG, ["algo.total_updates=64", "algo.updates_per_phase=4",
                                 "algo.prompts_per_phase=128"])
    assert cost.compare(short, SPEC, 8, 8)[1].phases == 1


def test_plan_prints_both_runs_with_the_models_config(capsys):
    args = ["plan", "--config", str(CONFIG), "--world-size", "8", "--gpus-per-node", "8"]
    assert main(args) == 0
    assert "phase cost: needs the model's config.json" in capsys.readouterr().out
    assert main(args + ["--hf-config", str(MODEL)]) == 0
    out = capsys.readouterr().out
    assert "GRPO mu=4          1024" in out and "Mu-GRPO mu=1024       4" in out
    assert "x faster than GRPO mu=4" in out and "assumptions: gpu_gib 79.6" in out

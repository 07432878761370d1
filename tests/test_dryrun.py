"""Every shipped config passes --dry-run at its intended world size; bad layouts are refused."""

import math

import pytest
from helpers import ROOT

from mugrpo_megatron.__main__ import main
from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.dryrun import dry_run
from mugrpo_megatron.dryrun.memory import GIB, H100_GIB, activation_bytes, estimate
from mugrpo_megatron.layout import check_layout
from mugrpo_megatron.models.hf_config import read_model_spec

# config, world size, GPUs per node, architecture: the table scripts/dry_run_all.sh runs
CONFIGS = [tuple(line.split("\t")) for line in
           (ROOT / "configs" / "dry_run_targets.tsv").read_text().splitlines()
           if line and not line.startswith("#")]


def test_every_config_is_covered():
    configs = ROOT / "configs"
    assert {c[0] for c in CONFIGS} == {str(p.relative_to(configs).with_suffix(""))
                                       for p in configs.rglob("*.yaml")}


def test_the_engine_sleeps_without_a_host_copy_and_the_reference_is_budgeted():
    """vLLM sleeps at level 2: the host keeps its runtime and CUDA-graph pools, not its weights
    (at 70B TP 8 they were 19.3 GiB a GPU of pinned backups, 310 GiB a node in all). A KL term
    to a reference adds its weights' shards to the host, a 'reference' transition (the weights
    swapped into the learner's storages, one no-grad microbatch) and the seconds of its pass
    over a phase's tokens; an entropy bonus adds an fp32 copy of a microbatch's logits."""
    from mugrpo_megatron.dryrun.memory import (
        HOST_CHUNK,
        VLLM_GRAPH_POOL,
        VLLM_RUNTIME,
        EngineTensors,
        pinned,
    )

    spec = read_model_spec(ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    path = ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml"
    e = estimate(load_config(path), spec, 2, ranks_per_node=8)
    assert e["host_engine"] == pinned(VLLM_RUNTIME) + pinned(VLLM_GRAPH_POOL)
    weights = EngineTensors.of(spec, 8, "bfloat16")
    assert weights.pinned > 7 * e["host_engine"]  # what level 1 would have kept on the host
    assert e["host_per_node"] == 8 * (e["host_learner"] + e["host_engine"]) < 160 * GIB
    assert "reference" not in e["transitions"] and e["reference_seconds"] == 0
    kl = estimate(load_config(path, ["algo.kl_coef=0.01", "algo.entropy_coef=0.01"]), spec, 2,
                  ranks_per_node=8)
    assert kl["host_reference"] == math.ceil(kl["params"] / HOST_CHUNK) * HOST_CHUNK
    assert kl["host_per_node"] == e["host_per_node"] + 8 * kl["host_reference"]
    t = kl["transitions"]
    assert kl["params"] < t["reference"] - (kl["cuda_context"] + kl["nccl"] + kl["fp8_cache"]) \
        < kl["params"] + kl["logits"] + kl["activations"] / 4
    # 2 FLOPs a parameter a token, over the phase's tokens, at the stated MFU on 64 GPUs
    cfg = load_config(path)
    tokens = cfg.algo.prompts_per_phase * cfg.rollout.group_size * cfg.max_sequence_tokens
    assert kl["reference_tokens"] == tokens > 5e8
    assert kl["reference_seconds"] == pytest.approx(
        2 * kl["parameters_total"] * tokens / (64 * 0.4 * 989e12))
    assert kl["logits"] == pytest.approx(e["logits"] * (4 + 2 * 2 + 4) / (4 + 2 * 2))


@pytest.mark.parametrize("name, world, per_node, arch", CONFIGS)
def test_dry_run_fits(name, world, per_node, arch, capsys):
    rc = main(["train", "--config", str(ROOT / "configs" / f"{name}.yaml"), "--dry-run",
               "--world-size", world, "--gpus-per-node", per_node, "--hf-config",
               str(ROOT / "configs" / "models" / f"{arch}.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fits: yes" in out and f"world {world} =" in out
    spec = read_model_spec(ROOT / "configs" / "models" / f"{arch}.json")
    # an MoE's experts: one grouped GEMM a layer on GPUs, its workspace counted
    assert ("run as one grouped GEMM (Transformer Engine's TEGroupedMLP" in out) == spec.is_moe
    # a release stored quantized (DeepSeek-V3's official folder) is read dequantized, and said
    assert ("checkpoint: stored in block FP8 (e4m3, 128 x 128 blocks); each rank reads its "
            "shards dequantized into bfloat16" in out) == (spec.stored is not None)


def test_dry_run_refuses_what_does_not_fit():
    cfg = load_config(ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml",
                      ["parallel.tensor=2", "parallel.pipeline=1", "algo.samples_per_update=256"])
    with pytest.raises(ValueError, match="does not fit 79.6 GiB per GPU"):
        dry_run(cfg, 64, ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    with pytest.raises(ValueError, match="world size 9 is not divisible"):
        check_layout(load_config(ROOT / "configs" / "qwen2.5-math-7b_8xh100.yaml"), 9)
    cfg = load_config(ROOT / "configs" / "qwen2.5-math-7b_8xh100.yaml", ["parallel.tensor=8"])
    with pytest.raises(ValueError, match="does not divide the 28 attention heads"):
        dry_run(cfg, 8, ROOT / "configs" / "models" / "qwen2.5-math-7b.json")


def test_placement_is_checked_before_anything_starts(capsys):
    """Defect 5: rollout.tensor_parallel > 1 at world size 1 passed plan and the config checks,
    then failed at the first weight sync; an engine wider than a node failed only on the cluster."""
    assert main(["plan", "--set", "rollout.tensor_parallel=2"]) == 2
    assert "rollout.tensor_parallel: 2 must divide the world size 1" in capsys.readouterr().err
    assert main(["train", "--set", "rollout.tensor_parallel=2", "--set", "model.path=/nowhere"]) == 2
    assert "launch through torchrun" in capsys.readouterr().err  # refused before model or run dir
    cfg = ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml"
    # vLLM's replica at TP 8 on nodes of 4 spans two of them; on nodes of 12 it would take part
    # of a second node, and SGLang's engine (one a node) cannot span nodes at all
    assert main(["plan", "--config", str(cfg), "--world-size", "64", "--gpus-per-node", "4"]) == 0
    assert "8 vllm replica(s) at TP 8, each spanning 2 nodes" in capsys.readouterr().out
    assert main(["plan", "--config", str(cfg), "--world-size", "96", "--gpus-per-node", "12"]) == 2
    assert "8 must divide the 12 GPUs per node, or be a multiple of them" in capsys.readouterr().err
    assert main(["train", "--config", str(cfg), "--dry-run", "--world-size", "64",
                 "--gpus-per-node", "4", "--set", "rollout.engine=sglang", "--hf-config",
                 str(ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")]) == 2
    assert "8 must not exceed the 4 GPUs per node with sglang" in capsys.readouterr().err
    assert main(["train", "--dry-run"]) == 2  # no model.path, no --hf-config: not the cwd's
    assert "model.path: not set" in capsys.readouterr().err


def test_every_transition_of_a_phase_is_budgeted():
    """The dry run's verdict is the largest of the phase's transitions; FP8's weight caches and
    NCCL's buffers count where no offload frees them; an evaluation meets the whole engine
    without the learner; a sync meets one of the learner's weights at a time (it streams from the
    learner's host copy) beside the engine's weights and the pools vLLM wakes with them,
    the stream and what the engine's reload holds of it; a sleeping engine holds nothing on the
    device (vLLM 0.32-0.33 backs its pools up to the host); the margin is kept, of the 79.6 GiB
    CUDA reports of an 80 GB H100."""
    from mugrpo_megatron.dryrun.memory import TRANSITIONS, communicators

    spec = read_model_spec(ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    cfg = load_config(ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml")
    e = estimate(cfg, spec, 2, ranks_per_node=8)
    t = e["transitions"]
    assert tuple(t) == tuple(n for n in TRANSITIONS if n != "reference")
    assert e["peak"] == max(t.values())
    assert e["gpu_gib"] == H100_GIB == 79.6
    assert e["fp8_cache"] > 2 * GIB  # ~2 bytes a GEMM weight of the rank's 2.2B parameters
    assert t["evaluate"] == t["generate"] < t["generate"] + e["learner_state"]
    assert t["optimize"] >= e["learner_state"] + e["activations"] + e["fp8_cache"] + e["logits"]
    # offloaded, a sync streams from the host copy: one parameter on the device at a time, the
    # largest the vocabulary's shard (128256 padded to 129024, over 8 ranks, of 8192 in bf16)
    assert e["learner_at_sync"] == 129024 // 8 * 8192 * 2 < e["params"] / 10
    resident = e["cuda_context"] + e["nccl"] + e["fp8_cache"]
    assert t["sync"] == pytest.approx(resident + e["learner_at_sync"] + e["engine_weights"]
                                      + e["engine_pools"] + e["stream"] + e["reload"])
    assert t["save"] == pytest.approx(resident + e["learner_state"])  # the engine asleep: 0
    assert e["nccl"] == sum(communicators(cfg, 2).values()) * 0.5 * GIB
    assert e["peak"] + e["margin"] <= H100_GIB * GIB  # the shipped config keeps the margin
    resident_learner = estimate(load_config(ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml",
                                            ["parallel.offload_learner=never"]), spec, 2,
                                ranks_per_node=8)
    assert resident_learner["transitions"]["generate"] == pytest.approx(
        t["generate"] + e["learner_state"])
    # fits without the margin, not with it: refused
    tight = load_config(ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml",
                        ["rollout.gpu_memory_utilization=0.85"])
    squeezed = estimate(tight, spec, 2, ranks_per_node=8)
    assert squeezed["peak"] <= H100_GIB * GIB < squeezed["peak"] + squeezed["margin"], \
        squeezed["peak"] / GIB
    with pytest.raises(ValueError, match="at generate, plus the margin"):
        dry_run(tight, 64, ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json",
                gpus_per_node=8)


@pytest.mark.parametrize("name, world, per_node, arch", CONFIGS)
def test_configs_recompute_only_what_memory_needs(name, world, per_node, arch):
    """Every shipped config recomputes the least the dry run finds to fit (none before selective
    before full): full recomputation costs about a third more compute an update, 4096 times a
    phase; a config that recomputes what memory does not need wastes it."""
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    spec = read_model_spec(ROOT / "configs" / "models" / f"{arch}.json")
    e = estimate(cfg, spec, cfg.parallel.data_parallel(int(world)), ranks_per_node=int(per_node))
    assert cfg.model.recompute == e["cheapest_recompute"], e["peak_by_recompute"]


def test_recompute_choices_are_estimated():
    """Full recomputation keeps each layer's input (divided by TP with sequence parallel) for
    every microbatch in flight and one layer's activations; selective drops only attention's
    s^2 scores, which flash attention never stores; the choice changes only the optimizer's
    transition."""
    cfg = load_config(ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml")
    spec = read_model_spec(ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    dp = 2
    none, in_flight = activation_bytes(cfg, spec, dp, "none")
    full, _ = activation_bytes(cfg, spec, dp, "full")
    s, h, tp = 4096, spec.hidden_size, 8  # 1024 prompt + 3072 response tokens, micro-batch 1
    layers = spec.num_layers / 4
    assert in_flight == 4
    assert none == pytest.approx(s * h * 34 / tp * layers * in_flight)
    assert full == pytest.approx(2 * s * h / tp * layers * in_flight + s * h * 34 / tp)
    assert activation_bytes(cfg, spec, dp, "selective")[0] == none
    e = estimate(cfg, spec, 2, ranks_per_node=8)
    assert e["peak_by_recompute"]["none"] >= e["peak_by_recompute"]["full"]
    assert e["activations"] == none and e["transitions"]["optimize"] > 40 * GIB


@pytest.mark.parametrize("command", ["train", "dry-run", "convert"])
def test_a_bad_layout_is_refused_before_any_process_group(tmp_path, command, capsys,
                                                          monkeypatch):
    """layout.check_layout, the one check: Qwen3-30B-A3B's 48 layers do not split over 5
    pipeline stages, and train, train --dry-run and convert each say so in the same words before
    any process group exists or anything is written (the learner's model build runs the same
    check_model). train also refuses the mixture of experts at TP 2 without sequence parallel."""
    import shutil

    import torch.distributed as dist

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(ROOT / "configs" / "models" / "qwen3-30b-a3b.json", model / "config.json")
    monkeypatch.setenv("WORLD_SIZE", "5")
    run, out = tmp_path / "run", tmp_path / "converted"
    argv = {"train": ["train", "--set", f"model.path={model}", "--set", f"logging.run_dir={run}",
                      "--set", "parallel.pipeline=5"],
            "dry-run": ["train", "--dry-run", "--world-size", "5", "--hf-config",
                        str(model / "config.json"), "--set", "parallel.pipeline=5"],
            "convert": ["convert", "--to", "megatron", "--hf-dir", str(model), "--out", str(out),
                        "--pp", "5"]}[command]
    assert main(argv) == 2
    assert "parallel.pipeline x virtual_pipeline = 5 does not divide the 48 layers" in \
        capsys.readouterr().err
    assert not dist.is_initialized() and not run.exists() and not out.exists()
    if command == "train":
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(["train", "--set", f"model.path={model}", "--set", f"logging.run_dir={run}",
                     "--set", "parallel.tensor=2"]) == 2
        assert "parallel.sequence_parallel: megatron-core needs it" in capsys.readouterr().err
        assert not dist.is_initialized() and not run.exists()


@pytest.mark.parametrize("name, world, per_node, arch", CONFIGS)
def test_every_config_runs_the_checks_it_promises(name, world, per_node, arch):
    """At its documented world size every shipped config's checks score rows on every
    data-parallel rank: the mismatch check (rollout.mismatch_check_samples, after each sync) and,
    where the learner packs on a GPU (pack_tokens auto with TE), the packing check. At DP16 the
    30B-A3B config's 4 and 8 rows were cut to 0 by a multiple of DP, and both checks returned
    None without a word."""
    from mugrpo_megatron.layout import pack_capacity, token_multiple
    from mugrpo_megatron.phase.checks import PACKING_CHECK_ROWS, spread_rows

    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    dp = cfg.parallel.data_parallel(int(world))
    samples = cfg.algo.prompts_per_phase * cfg.rollout.group_size
    checks = {"mismatch": cfg.rollout.mismatch_check_samples}
    if pack_capacity(cfg.parallel, cfg.max_sequence_tokens, thd=True,
                     multiple=token_multiple(cfg.model, cfg.parallel)):
        checks["packing"] = PACKING_CHECK_ROWS
    assert checks["mismatch"] > 0, "every shipped config checks the train/inference gap"
    for check, n in checks.items():
        rows = spread_rows(samples, n, dp)
        assert len(rows) >= max(n, dp) and len(rows) % dp == 0, (check, len(rows), dp)
        assert len(set(rows.tolist())) == len(rows)  # distinct rows where the phase has them
        assert rows.min() >= 0 and rows.max() < samples
    # a phase smaller than the data-parallel size still gives every rank a row (repeated)
    assert len(spread_rows(3, 4, 16)) == 16 and set(spread_rows(3, 4, 16).tolist()) == {0, 1, 2}
    assert len(spread_rows(samples, 0, dp)) == 0  # the check turned off


def test_the_engine_share_the_dry_run_names_is_the_largest_that_fits():
    """The largest rollout.gpu_memory_utilization each engine-awake transition allows: set to
    it (rounded down to a hundredth), the 70B config's generate transition fits with the margin;
    0.02 more does not; and the sequences a replica holds at once are its KV tokens over the
    longest sequence, at the configured share and at that largest one."""
    path = ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml"
    spec = read_model_spec(ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    e = estimate(load_config(path), spec, 2, ranks_per_node=8)
    assert set(e["engine_share_max"]) == {"start", "generate", "evaluate"}
    share = min(e["engine_share_max"].values())
    gpu = H100_GIB * GIB

    def generate_fits(u: float) -> bool:
        got = estimate(load_config(path, [f"rollout.gpu_memory_utilization={u}"]), spec, 2,
                       ranks_per_node=8)
        return got["transitions"]["generate"] + got["margin"] <= gpu

    assert generate_fits(math.floor(share * 100) / 100)
    assert not generate_fits(math.floor(share * 100) / 100 + 0.02)
    cfg = load_config(path)
    assert e["sequences_at_once"] == int(e["kv_tokens"] // cfg.max_sequence_tokens) > 0
    assert e["sequences_at_share_max"] > e["sequences_at_once"]
    text = dry_run(cfg, 64, ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json",
                   gpus_per_node=8)
    assert f"generate {e['engine_share_max']['generate']:.2f}" in text


def test_context_parallel_in_the_dry_run():
    """Under CP a rank holds 2 of a row's 2 x CP chunks: its activations and logits are the
    row's share, its optimizer state is sharded over DP x CP (megatron's dp_cp group), and TE's
    K/V ring adds two buffers of a rank's K and V (forward and backward)."""
    path = ROOT / "configs" / "qwen2.5-math-7b_8xh100.yaml"
    spec = read_model_spec(ROOT / "configs" / "models" / "qwen2.5-math-7b.json")
    sets = ["parallel.pipeline=1", "parallel.tensor=2", "parallel.sequence_parallel=true",
            "parallel.pack_tokens=0", "rollout.max_new_tokens=16384"]
    one = estimate(load_config(path, sets), spec, 4, ranks_per_node=8)
    cfg = load_config(path, [*sets, "parallel.context=2"])
    two = estimate(cfg, spec, 2, ranks_per_node=8)
    assert two["activations"] == pytest.approx(one["activations"] / 2)
    assert two["logits"] == pytest.approx(one["logits"] / 2)
    assert two["optimizer"] == pytest.approx(one["optimizer"])  # DP 4 = DP 2 x CP 2
    tokens = cfg.parallel.micro_batch_size * cfg.max_sequence_tokens / 2
    assert two["cp_ring"] == 4 * 2 * tokens * spec.num_kv_heads / 2 * spec.head_dim * 2
    assert one["cp_ring"] == 0
    # packed (auto on TE): a CP rank's share of a packed row, the same tokens as padded here
    packed = estimate(load_config(path, [*sets[:-2], "rollout.max_new_tokens=16384",
                                         "parallel.context=2"]), spec, 2, ranks_per_node=8)
    assert packed["activations"] == pytest.approx(two["activations"], rel=0.01)


def test_the_learner_update_time_from_stated_rates():
    """The dry run's seconds an update: the weight GEMMs are 2 FLOPs a matmul parameter a token
    (every parameter but the embedding's, the norms' and the biases'), causal attention
    layers x 2 x s^2 x query width, a training pass three forwards and full recomputation a
    fourth; twice the GPUs at CP4 instead of CP2 halve the time."""
    from mugrpo_megatron.dryrun.compute import forward_flops, update_seconds
    from mugrpo_megatron.dryrun.memory import ASSUMED_MFU, DATASHEET_BF16

    spec = read_model_spec(ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    gemm, core = forward_flops(spec, 1000)
    norms = (2 * spec.num_layers + 1) * spec.hidden_size
    matmul = spec.num_parameters() - spec.vocab_size * spec.hidden_size - norms
    assert gemm == 2 * 1000 * matmul
    assert core == spec.num_layers * 2 * 1000 ** 2 * spec.num_heads * spec.head_dim
    path = ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml"
    sets = ["rollout.max_new_tokens=32768", "model.recompute=none"]
    cfg = load_config(path, [*sets, "parallel.context=4"])
    gemm, core = forward_flops(spec, cfg.max_sequence_tokens)
    u4 = update_seconds(cfg, spec, dp=1, world=128)
    assert u4["flops"] == cfg.algo.samples_per_update * 3 * (gemm + core)
    assert u4["seconds"] == pytest.approx(
        u4["flops"] * (1 + u4["bubble"]) / (128 * ASSUMED_MFU * DATASHEET_BF16))
    full = update_seconds(load_config(path, ["rollout.max_new_tokens=32768",
                                             "model.recompute=full", "parallel.context=4"]),
                          spec, dp=1, world=128)
    assert full["flops"] == pytest.approx(u4["flops"] * 4 / 3)
    u2 = update_seconds(load_config(path, [*sets, "parallel.context=2"]), spec, dp=1, world=64)
    assert u2["seconds"] == pytest.approx(2 * u4["seconds"], rel=0.02)


def test_expert_state_is_sharded_as_megatron_groups_the_experts():
    """megatron-core makes the expert-data-parallel size world / (expert TP x EP x PP) = DP x CP
    / EP: expert layers see no context parallelism, so CP ranks shard the experts' optimizer
    state as DP ranks do. Same world, EP and TP: CP2 x DP4 and DP8 give the same expert shard,
    and only the dense state's shard (over DP x CP) is the same too."""
    spec = read_model_spec(ROOT / "configs" / "models" / "qwen3-30b-a3b.json")
    sets = ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=4",
            "parallel.distributed_optimizer=true", "algo.samples_per_update=64",
            "parallel.micro_batch_size=1"]
    cp1 = estimate(load_config(None, sets), spec, dp=8)
    cp2 = estimate(load_config(None, [*sets, "parallel.context=2"]), spec, dp=4)
    assert math.isclose(cp1["optimizer"], cp2["optimizer"], rel_tol=1e-9)
    # the experts' share of the optimizer: 12 bytes a parameter over DP x CP / EP = 2 ranks
    moe_layers = spec.num_layers
    experts_here = spec.num_experts * 3 * spec.hidden_size * spec.moe_ffn_hidden_size * moe_layers \
        / (2 * 4)
    assert cp2["optimizer"] > 12 * experts_here / 2


def test_a_sync_is_cut_for_the_engine_where_the_stream_can():
    """The dry run's 'weight sync' line: each rank receives 1/(engine TP) of the projections and
    experts where vLLM runs spmd at the learner's TP (its own shards) or at a multiple of it (its
    engine slices, from the ranks that hold them: Qwen3-235B's and DeepSeek-V3's TP16 beside
    TP4 and TP8), every tensor whole otherwise; and ``engine_slices_problem`` names why a
    layout cannot be cut (the rules ``learner.engine_slices`` relies on)."""
    from mugrpo_megatron.layout.shapes import engine_slices_problem

    cases = {"qwen3-235b-a22b_16x8xh100_8k": ("qwen3-235b-a22b", 128, "engine slices"),
             "deepseek-v3_32x8xh100_8k": ("deepseek-v3", 256, "engine slices"),
             "llama-3.1-70b_8x8xh100_fp8": ("llama-3.1-70b-instruct", 64, "own shards")}
    for name, (model, world, cut) in cases.items():
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", [])
        spec = read_model_spec(ROOT / "configs" / "models" / f"{model}.json")
        p = cfg.parallel
        e = estimate(cfg, spec, dp=p.data_parallel(world))
        assert e["sync_cut"] == cut, (name, e["sync_cut"])
        whole = spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2)
        per_rank = (whole + (spec.num_parameters() - whole) / cfg.rollout.tensor_parallel) * 2
        assert math.isclose(e["sync_bytes"], per_rank, rel_tol=1e-9), name
        assert e["sync_bytes"] < spec.num_parameters() * 2 / 5  # not every tensor whole
    spec = read_model_spec(ROOT / "configs" / "models" / "qwen3-235b-a22b.json")  # 4 KV heads
    assert engine_slices_problem(spec, 4, 16, 64) is None
    assert "not a multiple" in engine_slices_problem(spec, 4, 6, 64)
    assert "not a multiple" in engine_slices_problem(spec, 4, 4, 64)  # own shards: no cut
    assert "does not divide a pipeline stage's 8 ranks" in engine_slices_problem(spec, 1, 16, 8)
    odd = read_model_spec(ROOT / "configs" / "models" / "qwen2.5-math-7b.json")  # 28 heads
    assert "attention heads (28)" in engine_slices_problem(odd, 2, 8, 8)

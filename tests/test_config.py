"""Config: YAML loading, dotted overrides, unknown keys, type and value errors that name the key."""

import dataclasses
from pathlib import Path

import pytest

from mugrpo_megatron.config import Config
from mugrpo_megatron.config.loader import describe, dump_yaml, field_docs, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_has_a_docstring():
    sections = [Config] + [f.type if isinstance(f.type, type) else type(getattr(Config(), f.name))
                           for f in dataclasses.fields(Config)]
    for cls in sections:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    assert "veto_threshold" in describe()


def test_configs_in_repo_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert isinstance(cfg, Config), path


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  clip_high: 0.28\n  veto_threshold: 1e-4\nrollout:\n  group_size: 4\n")
    cfg = load_config(p, ["algo.clip_high=4.0", "algo.veto_scope=sequence", "optim.lr=3e-6",
                          "algo.veto_threshold=null", "model.path=/x"])
    assert cfg.algo.clip_high == 4.0 and isinstance(cfg.algo.clip_high, float)
    assert cfg.algo.veto_scope == "sequence" and cfg.algo.veto_threshold is None
    assert cfg.optim.lr == 3e-6 and cfg.rollout.group_size == 4 and cfg.model.path == "/x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algo.clip_high = 1.0  # type: ignore[misc]
    # the dump reloads to the same config
    p2 = tmp_path / "d.yaml"
    p2.write_text(dump_yaml(cfg))
    assert load_config(p2) == cfg


@pytest.mark.parametrize("override, message", [
    ("algo.clip_hgh=4", r"algo\.clip_hgh: unknown key \(did you mean algo\.clip_high\?\)"),
    ("algorithm.mu=4", r"algorithm: unknown key"),
    ("model.recompute_activations=true",
     r"model\.recompute_activations: replaced by model\.recompute: none, selective or full"),
    ("model.recompute=some", r"model\.recompute: must be one of \['none', 'selective', 'full'\]"),
    ("algo.clip_low=1.5", r"algo\.clip_low: must be in \[0, 1\].*got 1\.5"),
    ("algo.clip_high=high", r"algo\.clip_high: must be a number or 'auto', got 'high'"),
    ("algo.clip_high_auto_grid=[1, 0.5]", r"algo\.clip_high_auto_grid: must be 1 to 8 increasing"),
    ("algo.clip_high_auto_ess=0", r"algo\.clip_high_auto_ess: must be in \(0, 1\]"),
    ("algo.veto_scope=prefixes", r"algo\.veto_scope: must be one of .*got 'prefixes'"),
    ("algo.veto_threshold=2", r"algo\.veto_threshold: must be in \(0, 1\) or null, got 2\.0"),
    ("algo.updates_per_phase=3", r"algo\.total_updates: must be a multiple of algo\.updates_per_phase"),
    ("rollout.group_size=0", r"rollout\.group_size: must be > 0, got 0"),
    ("rollout.group_size=2.5", r"rollout\.group_size: must be an integer, got 2\.5"),
    ("rollout.top_p=0", r"rollout\.top_p: must be in \(0, 1\], got 0\.0"),
    ("parallel.sequence_parallel=true", r"parallel\.sequence_parallel: needs parallel\.tensor > 1"),
    ("parallel.virtual_pipeline=2", r"parallel\.virtual_pipeline: needs parallel\.pipeline >= 2"),
    ("model.trust_remote_code=yes please", r"model\.trust_remote_code: must be true or false"),
    ("data.on_bad_row=ignore", r"data\.on_bad_row: must be one of \['error', 'skip'\]"),
    ("algo.clip_high=inf", r"algo\.clip_high: must be a finite number, got 'inf'"),
    ("reward.timeout_s=.inf", r"reward\.timeout_s: must be a finite number, got inf"),
    ("optim.lr=nan", r"optim\.lr: must be a finite number, got 'nan'"),
    ("optim.min_lr=1", r"optim\.min_lr: must be <= optim\.lr"),
    ("algo=3", r"algo: expected a mapping, got 3"),
    ("algo.samples_per_update=100000", r"algo\.samples_per_update: 100000 is more than a phase"),
    ("novalue", r"expected KEY=VALUE"),
    ("model.router_aux_loss_coeff=0.01",
     r"model\.router_aux_loss_coeff: model\.router_load_balancing is 'none': set both"),
    ("model.router_load_balancing=aux_loss", r"model\.router_aux_loss_coeff: .*'aux_loss'"),
    ("model.router_dtype=bf16", r"model\.router_dtype: must be one of \['fp32', 'fp64'\]"),
    ("parallel.context=0", r"parallel\.context: must be > 0"),
    ("rollout.max_tool_calls_per_turn=0", r"rollout\.max_tool_calls_per_turn: must be > 0"),
    ("logging.eval_samples=some", r"logging\.eval_samples: must be one of"),
    ("model.router_bias_update_rate=-0.001", r"model\.router_bias_update_rate: must be >= 0"),
    ("reward.sandbox=http://", r"reward\.sandbox: is not a URL with a host"),
    ("reward.sandbox=docker", r"reward\.sandbox: must be 'bwrap' \(the OS sandbox\), the http\(s\) "
                              r"URL of a SandboxFusion service, or 'unsafe'"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_saves_off_the_phase_ends_need_fixed_length_phases():
    assert not load_config(None, ["checkpoint.save_at_phase_end=false"]).checkpoint.save_at_phase_end
    with pytest.raises(ValueError, match=r"checkpoint\.save_at_phase_end: false needs phases of a "
                                         r"fixed length, and algo\.max_drift ends them"):
        load_config(None, ["checkpoint.save_at_phase_end=false", "algo.max_drift=0.05"])


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("reward:\n  timeout: 3\n")
    with pytest.raises(ValueError,
                       match=r"reward\.timeout: unknown key \(did you mean reward\.timeout_s\?\)"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_config(p)


def test_world_size_checks():
    from mugrpo_megatron.layout import check_layout

    cfg = load_config(None, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.micro_batch_size=2",
                             "algo.samples_per_update=64"])
    assert check_layout(cfg, 8).data_parallel == 2
    with pytest.raises(ValueError,
                       match=r"world size 6 is not divisible by parallel\.tensor x parallel\.pipeline"):
        check_layout(cfg, 6)
    with pytest.raises(ValueError, match=r"algo\.samples_per_update: 64 is not divisible by .* 24 x 2"):
        check_layout(cfg, 96)


def test_engine_placement():
    assert load_config(None, []).rollout.spmd  # vLLM: a replica per rollout.tensor_parallel ranks
    assert not load_config(None, ["rollout.engine=sglang"]).rollout.spmd
    assert not load_config(None, ["rollout.placement=rank0"]).rollout.spmd
    with pytest.raises(ValueError, match=r"rollout\.placement: spmd needs vLLM's external launcher"):
        load_config(None, ["rollout.engine=sglang", "rollout.placement=spmd"])
    # vLLM on rank 0 alone would run its other TP ranks in its own processes, out of the stream's reach
    with pytest.raises(ValueError, match=r"rollout\.placement: rank0 with vLLM needs "
                                         r"rollout\.tensor_parallel = 1 \(got 2\)"):
        load_config(None, ["rollout.placement=rank0", "rollout.tensor_parallel=2"])
    assert load_config(None, ["rollout.engine=sglang", "rollout.tensor_parallel=2"])
    from mugrpo_megatron.layout import check_layout, placement

    cfg = load_config(None, ["rollout.tensor_parallel=4", "parallel.micro_batch_size=1",
                             "algo.samples_per_update=48"])
    layout = check_layout(cfg, 8)
    assert layout.data_parallel == 8 and layout.placement.replicas == 2
    assert [layout.placement.replica(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [r for r in range(8) if layout.placement.leads(r)] == [0, 4]
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel: 4 must divide the world size 6"):
        check_layout(cfg, 6)
    # one SGLang engine a node, on its first rank; one vLLM engine on rank 0; spmd on one rank
    node = placement(load_config(None, ["rollout.engine=sglang"]).rollout, 16, 8)
    assert (node.kind, node.replicas, [r for r in range(16) if node.hosts(r)]) == ("node", 2, [0, 8])
    rank0 = placement(load_config(None, ["rollout.placement=rank0"]).rollout, 4)
    assert (rank0.kind, rank0.replicas, [r for r in range(4) if rank0.hosts(r)]) == ("rank0", 1, [0])
    assert placement(load_config(None, []).rollout, 1).kind == "rank0"
    # a vLLM replica larger than a node takes whole nodes: TP 16 on 4 nodes of 8 is 2 replicas
    wide = placement(load_config(None, ["rollout.tensor_parallel=16"]).rollout, 32, 8)
    assert (wide.replicas, wide.nodes_per_replica, [r for r in range(32) if wide.leads(r)]) \
        == (2, 2, [0, 16])
    assert [wide.replica(r) for r in (0, 8, 15, 16, 31)] == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"12 must divide the 8 GPUs per node, or be a multiple"):
        placement(load_config(None, ["rollout.tensor_parallel=12"]).rollout, 48, 8)
    with pytest.raises(ValueError, match=r"16 must not exceed the 8 GPUs per node with sglang"):
        placement(load_config(None, ["rollout.engine=sglang", "rollout.tensor_parallel=16"]).rollout,
                  32, 8)


def test_checks_are_value_errors_also_for_direct_construction():
    from mugrpo_megatron.config import AlgoConfig

    with pytest.raises(ValueError, match=r"algo\.veto_scope: must be one of"):
        AlgoConfig(veto_scope="prefixes")


def test_config_file_errors_name_the_file_and_line(tmp_path):
    """Defect: YAML that does not parse, or a missing file, ended in a raw traceback."""
    with pytest.raises(ValueError, match=r"--config: .*nope\.yaml: no such file"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("algo:\n  clip_high: 4.0\n rollout: [\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: line 3, column 2: not valid YAML"):
        load_config(p)
    p.write_bytes(b"algo:\n  clip_high: \xff\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: not UTF-8 text"):
        load_config(p)


def test_router_settings_need_a_mixture_of_experts():
    from mugrpo_megatron.config import ModelConfig, ParallelConfig
    from mugrpo_megatron.layout import check_model
    from mugrpo_megatron.models.hf_config import model_spec_from_dict

    dense = model_spec_from_dict({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                  "hidden_size": 32, "intermediate_size": 64,
                                  "num_attention_heads": 4, "vocab_size": 100})
    check_model(dense, ModelConfig(), ParallelConfig())
    for sets in ({"freeze_router": True}, {"router_dtype": "fp64"},
                 {"router_load_balancing": "aux_loss", "router_aux_loss_coeff": 0.01}):
        with pytest.raises(ValueError, match=rf"model\.{next(iter(sets))}: .* needs a "
                                             r"mixture-of-experts model; LlamaForCausalLM is dense"):
            check_model(dense, ModelConfig(**sets), ParallelConfig())
    with pytest.raises(ValueError, match=r"model\.freeze_router: a frozen router has no load"):
        ModelConfig(freeze_router=True, router_load_balancing="aux_loss", router_aux_loss_coeff=0.1)


def test_context_parallel_layouts():
    """world = TP x PP x CP x DP; what CP does not do yet is refused by key before anything
    starts (a mixture of experts' load-balancing loss); 'auto' pads under CP."""
    from mugrpo_megatron.layout import check_layout, check_model
    from mugrpo_megatron.layout.shapes import pack_capacity, token_multiple
    from mugrpo_megatron.models.hf_config import model_spec_from_dict

    cfg = load_config(None, ["parallel.tensor=2", "parallel.context=2",
                             "parallel.sequence_parallel=true", "algo.samples_per_update=64"])
    assert check_layout(cfg, 16).data_parallel == 4
    with pytest.raises(ValueError, match=r"world size 10 is not divisible by parallel\.tensor x "
                                         r"parallel\.pipeline x parallel\.context = 2 x 1 x 2"):
        check_layout(cfg, 10)
    # a row cuts into 2 x CP chunks, each rank's two a multiple of TP (sequence parallel)
    assert token_multiple(cfg.model, cfg.parallel) == 8
    # packed rows under CP (TE's THD rule): auto packs where TE is, rows a multiple of the above
    assert pack_capacity(cfg.parallel, 4095, thd=True, multiple=8) == 4096
    assert pack_capacity(cfg.parallel, 4095, thd=False, multiple=8) == 0
    assert load_config(None, ["parallel.context=2", "parallel.pack_tokens=2048"]).parallel \
        .pack_tokens == 2048
    moe = model_spec_from_dict({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
                                "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 16})
    check_model(moe, cfg.model, cfg.parallel)  # MoE under CP, but not with the aux loss
    with pytest.raises(ValueError, match=r"model\.router_load_balancing: 'seq_aux_loss' with "
                                         r"parallel\.context > 1"):
        check_model(moe, dataclasses.replace(cfg.model, router_load_balancing="seq_aux_loss",
                                             router_aux_loss_coeff=0.001), cfg.parallel)


def test_a_run_config_with_tools_loads_back_as_itself(tmp_path):
    """A run's config.yaml held the tools' schemas (put into data.chat_template_kwargs from
    rollout.tools), which the loader refuses: every `rollouts` of a tool run and the resume
    refusal's own advice failed on it. Written and read back, the config is the same."""
    cfg = load_config(ROOT / "configs/demo_cpu.yaml", ["rollout.tools=[python]",
                                                       "data.chat_template_kwargs={flag: true}"])
    assert [t["function"]["name"] for t in cfg.data.chat_template_kwargs["tools"]] == ["python"]
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("key, ours", [
    ("rollout.tool_config_path=tools.yaml", "rollout.tools, a list of 'python'"),
    ("rollout.max_parallel_calls=2", "rollout.max_tool_calls_per_turn"),
    ("logging.validation_data_dir=x", "logging.eval_samples"),
    ("rollout.max_tool_response_length=256", "rollout.tool_output_chars"),
    ("rollout.max_assistant_turns=4", "rollout.max_turns"),
    ("data.apply_chat_template_kwargs={enable_thinking: false}", "data.chat_template_kwargs")])
def test_verls_names_point_to_ours(key, ours):
    with pytest.raises(ValueError, match=f"{key.split('=')[0]}: verl's name; here it is {ours}"):
        load_config(ROOT / "configs/demo_cpu.yaml", [key])

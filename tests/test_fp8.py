"""FP8 requests fail clearly where they cannot run; the GPU check runs only on a GPU with TE."""

import types

import pytest
import torch

from mugrpo_megatron.config import ModelConfig
from mugrpo_megatron.learner.fp8 import fp8_kwargs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp8_without_gpu_is_refused():
    with pytest.raises(ValueError, match=r"model\.fp8_format: FP8 training needs a CUDA GPU"):
        fp8_kwargs(ModelConfig(dtype="bfloat16", fp8_format="hybrid"))


def test_fp8_needs_16_bit_training():
    with pytest.raises(ValueError, match=r"model\.dtype: FP8 training needs dtype bfloat16"):
        ModelConfig(dtype="float32", fp8_format="e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_kwargs_on_gpu():
    pytest.importorskip("transformer_engine.pytorch")
    kw = fp8_kwargs(ModelConfig(dtype="bfloat16", fp8_format="hybrid", fp8_recipe="delayed"))
    assert kw["fp8"] == "hybrid" and kw["fp8_recipe"] == "delayed"


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8", "blockwise"])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (8, True)])
def test_padded_rows_meet_transformer_engines_fp8_rules(recipe, tp, sp):
    """For any row length and micro-batch, the rows the learner pads (``token_multiple``) give
    every dense FP8 GEMM an input TE accepts: the column-parallel layers' input is this rank's
    slice of the sequence with sequence parallel ([s / tp, b, hidden], all-gathered quantized,
    so it must be quantizable too), the row-parallel layers' the whole sequence. Rules read in
    TE 2.0-2.18 (layout/shapes.py)."""
    from mugrpo_megatron.config import ParallelConfig
    from mugrpo_megatron.layout.shapes import gemm_inputs_ok, round_up, token_multiple

    quantizable = {"delayed": 1, "tensorwise": 1, "mxfp8": 32, "blockwise": 128}[recipe]
    model = ModelConfig(dtype="bfloat16", fp8_format="hybrid", fp8_recipe=recipe)
    parallel = ParallelConfig(tensor=tp, sequence_parallel=sp)
    multiple = token_multiple(model, parallel)
    hidden, mlp = 8192, 28672
    for seq in [1, 7, 15, 17, 24, 1021, 3071, 4096]:
        padded = round_up(seq, multiple)
        assert padded >= seq and padded - seq < multiple
        for micro in (1, 2, 3):
            column = ((padded // tp if sp else padded) * micro, hidden)
            row = (padded * micro, mlp // tp)
            assert gemm_inputs_ok(column) and gemm_inputs_ok(row), (seq, micro)
            assert column[0] % quantizable == 0, (seq, micro)
    # without FP8 only sequence parallel asks for a multiple (of TP)
    assert token_multiple(ModelConfig(), parallel) == (tp if sp else 1)
    assert token_multiple(ModelConfig(), ParallelConfig(pad_tokens_to=16)) == 16


def test_model_dims_are_checked_against_the_fp8_rule():
    from mugrpo_megatron.config import ParallelConfig
    from mugrpo_megatron.layout.shapes import check_model_dims
    from mugrpo_megatron.models.hf_config import model_spec_from_dict, read_model_spec

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    check_model_dims(read_model_spec(root / "configs" / "models" / "llama-3.1-70b-instruct.json"),
                     ParallelConfig(tensor=8, sequence_parallel=True))
    odd = model_spec_from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 96,
                                "intermediate_size": 200, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_hidden_layers": 2,
                                "vocab_size": 256})
    with pytest.raises(ValueError, match=r"linear_fc2 .* weight shape \[96, 100\]"):
        check_model_dims(odd, ParallelConfig(tensor=2))


def _fake_te(root, pytorch_part: str):
    """A ``transformer_engine`` package like TE 2.x's: its top level swallows an ImportError of
    its PyTorch part (``transformer_engine/__init__.py``, TE 2.0-2.20)."""
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("try:\n    from . import pytorch\nexcept ImportError:\n"
                                     "    pass\n")
    (pkg / "pytorch" / "__init__.py").write_text(pytorch_part)
    return root


@pytest.mark.parametrize("part, want", [
    ("", True),  # TE that imports: the learner runs it
    ("raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c1017SymbolA')",
     "does not import"),
])
def test_transformer_engine_is_used_only_when_its_pytorch_part_imports(tmp_path, monkeypatch,
                                                                       part, want):
    """A TE built against another torch (pip's isolated build) imports at the top and fails in
    its PyTorch part; the check used to import only the top and say yes, and the 7B and 30B
    configs then died in megatron's spec builder (NameError: TESpecProvider). Now it proves
    ``transformer_engine.pytorch`` imports, and says how to fix a broken one. No GPU: no TE."""
    import sys

    from mugrpo_megatron.learner.fp8 import transformer_engine_ready

    monkeypatch.syspath_prepend(str(_fake_te(tmp_path, part)))
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import transformer_engine  # noqa: F401 - the top level imports either way

    if want is True:
        assert transformer_engine_ready() is True
    else:
        with pytest.raises(ValueError, match=want) as e:
            transformer_engine_ready()
        assert "--no-build-isolation" in str(e.value) and "undefined symbol" in str(e.value)
        with pytest.raises(ValueError, match=want):
            fp8_kwargs(ModelConfig(dtype="bfloat16", fp8_format="hybrid"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert transformer_engine_ready() is False  # no GPU: megatron's local layers
    # the fake package leaves for good (monkeypatch.delitem would put it back at teardown, and a
    # later test's first import of megatron would then see a TE: attention.HAVE_TE True)
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        sys.modules.pop(name)


# ------------------------------------------------ FP8 extra state across a layout change on resume
#
# Transformer Engine keeps each layer's FP8 scaling state (delayed scaling: the scales and amax
# histories of its GEMMs' inputs, weights and gradients) as the module's ``_extra_state``: a uint8
# tensor holding a pickle (TE 2.x ``TransformerEngineBaseModule.get_extra_state``), unpickled by
# TE's ``set_extra_state``. megatron-core's TE layers give it to dist-checkpointing through
# ``make_sharded_tensors_for_checkpoint`` (``extensions/transformer_engine.py``, 0.16.1 and
# 0.19.2), which wraps it as a ShardedObject: one copy per layer (the layer's global offset, not
# the rank's), replica ids (0, tp rank, dp rank), so only TP rank 0 / DP rank 0 of the stage
# holding the layer writes it and every rank of any layout reads that copy (grouped experts: one
# copy per global expert index, by ``_split_extra_state``). That is correct only because the
# amaxes are reduced over TP x DP (``learner/fp8.py``: ``tp_only_amax_red`` False), so every
# replica holds the same scales. The test runs that path with a TE-format stand-in module (TE
# needs CUDA, tests/dist/fp8_state_worker.py): each rank's state is made distinct so the copy
# that comes back is identifiable.

LAYERS, OUT, IN = 2, 4, 3  # as in fp8_state_worker.py


@pytest.mark.slow
def test_fp8_extra_state_is_one_copy_a_layer_and_loads_in_any_layout(tmp_path):
    """TE's FP8 extra state through megatron-core's sharding and our checkpoint save and load
    (which refuses code-running pickles: the extra state is a uint8 tensor, so it passes):
    saved at TP2, PP2 and DP2, loaded at TP1 and across layouts, every rank gets the copy of TP
    rank 0 / DP rank 0 of the stage that held its layer, and the weights reshard as usual."""
    import json

    from helpers import ROOT, torchrun

    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    hf = str(make_tiny_checkpoint(tmp_path / "hf", "llama", seed=0))
    ck = {name: str(tmp_path / f"ckpt_{name}") for name in ("tp2", "pp2", "dp2")}

    def run(layout, ranks, save, loads):
        d = tmp_path / f"run_{layout}"
        d.mkdir()
        torchrun(ranks, ROOT / "tests" / "dist" / "fp8_state_worker.py", layout, hf, str(d),
                 save or "-", *loads)
        return [json.loads((d / f"rank{r}.json").read_text()) for r in range(ranks)]

    saved_pp2 = run("pp2", 2, ck["pp2"], [])
    saved_tp2 = run("tp2", 2, ck["tp2"], [ck["pp2"]])
    saved_dp2 = run("dp2", 2, ck["dp2"], [ck["tp2"]])
    (tp1,) = run("tp1", 1, None, [ck["tp2"], ck["pp2"], ck["dp2"]])

    # the rule itself: a ShardedObject per layer, at the layer's global offset, replicated over TP
    # and DP (only replica (0, 0, 0) is written)
    for records, layout in ((saved_tp2, "tp2"), (saved_pp2, "pp2"), (saved_dp2, "dp2")):
        for r in records:
            e = r["extra_state"]
            assert e["type"] == "ShardedObject" and e["global_shape"] == [LAYERS], (layout, e)
            assert e["global_offset"] == [r["layers"][0]], (layout, e)
            tp_rank, dp_rank = (r["rank"], 0) if layout == "tp2" else \
                (0, r["rank"]) if layout == "dp2" else (0, 0)
            assert e["replica_id"] == [0, tp_rank, dp_rank], (layout, e)

    def full(g):  # fp8_state_worker's weights
        return (torch.arange(OUT * IN, dtype=torch.float32).view(OUT, IN) + 100 * g).tolist()

    # what comes back: the scale of the rank that held TP rank 0 / DP rank 0 of the layer's stage
    # (global rank 0 at TP2 and DP2, rank g at PP2), whatever the loading layout
    want = {ck["tp2"]: [1.0, 2.0], ck["dp2"]: [1.0, 2.0], ck["pp2"]: [1.0, 2.1]}
    for path, scales in want.items():
        got = tp1["loads"][path]
        assert [m["scale"] for m in got] == pytest.approx(scales), (path, got)
        assert [m["weight"] for m in got] == [full(0), full(1)], path
    for r in saved_tp2:  # PP2's checkpoint read at TP2: each TP rank its half, the same scales
        got = r["loads"][ck["pp2"]]
        assert [m["scale"] for m in got] == pytest.approx([1.0, 2.1]), got
        assert [m["weight"] for m in got] == [
            torch.tensor(full(g)).chunk(2)[r["rank"]].tolist() for g in range(LAYERS)]
    for r in saved_dp2:  # TP2's checkpoint read by two DP replicas: both get TP rank 0's state
        assert [m["scale"] for m in r["loads"][ck["tp2"]]] == pytest.approx([1.0, 2.0])


class DelayedScalingBuffer:
    """A stand-in for Transformer Engine's ``FP8GlobalStateManager`` global amax buffer under
    delayed scaling (TE is not installed on CPU), in either of TE's layouts (``layout``): the
    buffer a class attribute of the manager (TE 2.9-2.14) or a field of its
    ``quantization_state`` (2.15-2.20); which versions have which is read from TE's released
    source by scripts/check_upstream.py (``test_each_te_layout_is_one_check_upstream_found``).
    Keys ``forward_<autocast>`` / ``backward_<autocast>``, each a list of modules'
    ``amax_history[0]`` views. ``cast`` folds a tensor's amax into its module's slot as TE's cast
    kernels do (a running max); ``reduce`` is a grad-enabled ``fp8_autocast`` exit: roll each
    history, zero its slot, scale = 448 / max(history) (``delayed_scaling.cu``,
    amax_compute_algo 'max'). ``UPSTREAM_DIGESTS``: the TE definitions it mirrors, as read
    (scripts/check_upstream.py fails when TE's source of them changes)."""

    UPSTREAM_DIGESTS = {  # read at TE 2.9.0, 2.11.0 and 2.20.2
        "transformer_engine.pytorch.quantization:FP8GlobalStateManager.split_key_in_buffer": (
            "2ac03490f77e5d25",),
        # reduce() stands for this exit's grad-enabled reduction (2.9/2.11, then 2.15+'s state)
        "transformer_engine.pytorch.quantization:FP8GlobalStateManager.autocast_exit": (
            "c2af0542004f53f3", "d94bdba4c0b93dea"),
    }

    def __init__(self, layout: str = "class"):
        self.histories: list[torch.Tensor] = []
        if layout == "class":
            self.global_amax_buffer: dict[str, list[torch.Tensor]] = {}
        else:
            self.quantization_state = types.SimpleNamespace(global_amax_buffer={})

    @property
    def buffer(self) -> dict[str, list[torch.Tensor]]:
        state = self.__dict__.get("quantization_state", self)
        return state.global_amax_buffer

    @staticmethod
    def split_key_in_buffer(key: str) -> tuple[bool, str]:
        forward, autocast = key.split("_", 1)
        return forward == "forward", autocast

    def register(self, length: int = 4) -> torch.Tensor:
        history = torch.zeros(length, 2)
        self.histories.append(history)
        self.buffer.setdefault("forward_recipe:group", []).append(history[0])
        self.buffer.setdefault("backward_recipe:group", []).append(torch.zeros(2))
        return history

    @staticmethod
    def cast(history: torch.Tensor, x: torch.Tensor) -> None:
        history[0] = torch.maximum(history[0], x.abs().amax(dim=0))

    def reduce(self) -> list[torch.Tensor]:
        scales = []
        for h in self.histories:
            last = h[0].clone()
            h.copy_(torch.cat([h[1:], last[None]]))
            h[0] = 0
            scales.append(448.0 / h.amax(dim=0))
        return scales


@pytest.mark.parametrize("layout", ["class", "state"])
def test_no_grad_fp8_passes_leave_the_next_updates_scaling_as_without_them(layout):
    """A no-grad pass with larger activations between two training microbatches: inside
    ``forward_amaxes_kept`` the histories and scales after the second microbatch are those of
    the run without the pass; without it the pass's amax enters the history (the rule the
    function exists for). A module first seen in the pass is left with a zero slot. In both of
    TE's layouts of the buffer (the "state" one, TE >= 2.15, raised AttributeError before)."""
    from mugrpo_megatron.learner.fp8 import forward_amaxes_kept

    def run(no_grad_pass, kept):
        te = DelayedScalingBuffer(layout)
        layer = te.register()
        te.cast(layer, torch.tensor([[1.0, -2.0]]))
        te.reduce()  # microbatch 1
        if no_grad_pass:
            with forward_amaxes_kept(kept, manager=te):
                te.cast(layer, torch.tensor([[50.0, 30.0]]))  # a phase's worst activation
                late = te.register()
                te.cast(late, torch.tensor([[7.0, 7.0]]))
            assert not late.any() or not kept
        te.cast(layer, torch.tensor([[3.0, 1.0]]))
        return te.reduce()[0], layer.clone()  # microbatch 2

    plain_scale, plain_history = run(False, True)
    kept_scale, kept_history = run(True, True)
    assert torch.equal(kept_scale, plain_scale) and torch.equal(kept_history, plain_history)
    folded_scale, _ = run(True, False)
    assert (folded_scale < plain_scale).all()  # 448/50 instead of 448/3
    with forward_amaxes_kept(False):  # no delayed scaling: nothing to keep, TE not imported
        pass


def test_each_te_layout_is_one_check_upstream_found():
    """The stand-in's two layouts are TE's: scripts/check_upstream.py found the buffer a class
    attribute in some release read and a field of quantization_state in others, never both."""
    import json

    from helpers import ROOT

    record = json.loads((ROOT / "tests" / "fixtures" / "upstream_api.json").read_text())
    name = "transformer_engine.pytorch.quantization.FP8GlobalStateManager."
    layouts = set()
    for release, got in record["read"].items():
        if release.startswith("transformer-engine=="):
            cls, state = (got["found"][name + n] for n in ("global_amax_buffer", "quantization_state"))
            assert (cls is None) != (state is None), release
            layouts.add("class" if cls else "state")
    assert layouts == {"class", "state"}

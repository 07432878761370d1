"""Checkpoints as they are released: some ship their weights quantized, and the loader reads
them dequantized, so that the learner trains (and the export writes) the model's own dtype.

Two layouts are read, each from what its ``config.json`` says (``quantization_config``):

- **block FP8** (``quant_method: fp8`` with ``weight_block_size``; DeepSeek-V3/R1's official
  folders, Qwen3's ``-FP8`` releases): each quantized ``<module>.weight`` is ``float8_e4m3fn``
  with ``<module>.weight_scale_inv`` beside it, one scale a ``bm x bn`` block, the last blocks
  of a row or column cut short where the shape is not a multiple; the weight is ``q * scale``
  block by block. Tensors without a scale (embeddings, the output layer, norms, routers, and
  whatever the release lists in ``modules_to_not_convert``) are kept as they are.
- **MXFP4** (``quant_method: mxfp4``; gpt-oss's experts): ``<name>_blocks`` [..., rows, G, 16]
  uint8, two e2m1 values a byte (the low nibble first), and ``<name>_scales`` [..., rows, G],
  one power of two a group of 32 (e8m0: the exponent + 127). transformers' checkpoints of the
  same model hold ``<name>`` as the transpose of the last two dimensions (``[E, H, 2I]`` for
  ``[E, 2I, H / 32, 16]`` blocks: ``integrations/mxfp4.py``, ``convert_moe_packed_tensors``),
  and that is the tensor read here.

Any other ``quant_method`` (AWQ, GPTQ, compressed-tensors, bitsandbytes, NVFP4's modelopt,
per-tensor FP8) is refused by name before anything is loaded (``read_checkpoint_quantization``).

Reads take an index of slices (a TP rank's rows or columns): only the blocks and scales that
cover it are read from disk. Plain torch (imported only by the reads), no megatron: the dry run
reads the config part.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are read: the config's checks need none
    import torch

FP8_SCALE_SUFFIX = "_scale_inv"
"""A block-FP8 weight's scale: ``<module>.weight`` -> ``<module>.weight_scale_inv``."""
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
"""An MXFP4 tensor's parts: ``<name>_blocks`` and ``<name>_scales``."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an e2m1 nibble (OCP microscaling formats 1.0, table 5)."""
MXFP4_GROUP = 32
"""Values a scale covers (16 bytes of two nibbles)."""

READ_METHODS = ("fp8", "mxfp4")
"""The ``quant_method`` values the loader dequantizes."""


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a released checkpoint's weights are stored (its ``quantization_config``)."""

    method: str
    """'fp8' (block FP8) or 'mxfp4'."""
    block: tuple[int, int] | None = None
    """Block FP8's ``weight_block_size``: rows x columns a scale covers."""

    def describe(self) -> str:
        if self.method == "fp8":
            return f"block FP8 (e4m3, {self.block[0]} x {self.block[1]} blocks)"
        return "MXFP4 (e2m1 in groups of 32 with a power-of-two scale)"


def read_checkpoint_quantization(cfg: dict[str, Any], source: str
                                 ) -> CheckpointQuantization | None:
    """The checkpoint's quantization from its config.json (None: stored unquantized);
    ValueError naming ``source`` and the method for what the loader cannot read."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "(none)")).lower()
    if method not in READ_METHODS:
        raise ValueError(
            f"{source}: quantization_config.quant_method {method!r}: checkpoints quantized so "
            f"are not read (the loader dequantizes block FP8, quant_method 'fp8' with "
            f"weight_block_size, as DeepSeek-V3 and Qwen3's -FP8 releases ship, and gpt-oss's "
            f"'mxfp4'); start from the model's bf16 release, or dequantize it first")
    if method == "mxfp4":
        return CheckpointQuantization("mxfp4")
    block = qc.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"{source}: quantization_config: quant_method 'fp8' with weight_block_size "
            f"{block!r}: only block FP8 ([rows, columns] a scale, e.g. [128, 128]) is read; "
            f"a per-tensor or per-channel FP8 checkpoint is not")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: quantization_config.fmt {fmt!r}: only e4m3 block FP8 is read")
    return CheckpointQuantization("fp8", (int(block[0]), int(block[1])))


def dequantized_config(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The config.json of the same model with dequantized weights (no ``quantization_config``),
    and what was dropped, said for the user (None: nothing was)."""
    if not config.get("quantization_config"):
        return config, None
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    method = config["quantization_config"].get("quant_method", "?")
    return out, f"quantization_config (quant_method {method!r}) dropped: the weights are written dequantized"


# ---------------------------------------------------------------- reads of one tensor

RawRead = Callable[[str, "tuple[slice, ...] | None"], "torch.Tensor"]
"""read(name, index) -> the stored tensor ``name``, or its ``index`` (slices, no steps)."""


def _bounds(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each dimension's [start, stop) under ``index`` (missing dimensions whole)."""
    index = tuple(index or ())
    out = []
    for dim, size in enumerate(shape):
        s = index[dim] if dim < len(index) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"a strided read ({s}) of a quantized tensor is not supported")
        out.append((start, max(start, stop)))
    return out


def read_block_fp8(read: RawRead, name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...],
                   index: tuple[slice, ...] | None, block: tuple[int, int]) -> torch.Tensor:
    """``name[index]`` of a block-FP8 weight (``shape``: its stored [rows, columns];
    ``scale_shape``: its scale's) in float32, reading only the e4m3 values of the index and the
    scales of the blocks that cover it."""
    bm, bn = block
    if len(shape) != 2:
        raise ValueError(f"{name}: block FP8 weights are 2-D; this one is {tuple(shape)}")
    want = (math.ceil(shape[0] / bm), math.ceil(shape[1] / bn))
    if tuple(scale_shape) != want:
        raise ValueError(f"{name}{FP8_SCALE_SUFFIX}: shape {tuple(scale_shape)}, expected {want} "
                         f"for a {tuple(shape)} weight in {bm} x {bn} blocks "
                         f"(quantization_config.weight_block_size)")
    (r0, r1), (c0, c1) = _bounds(index, shape)
    q = read(name, (slice(r0, r1), slice(c0, c1)))
    b0, b1 = r0 // bm, math.ceil(r1 / bm)
    d0, d1 = c0 // bn, math.ceil(c1 / bn)
    scale = read(name + FP8_SCALE_SUFFIX, (slice(b0, b1), slice(d0, d1))).float()
    scale = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    scale = scale[r0 - b0 * bm:r1 - b0 * bm, c0 - d0 * bn:c1 - d0 * bn]
    return q.float() * scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., G, 16] (uint8) and ``scales`` [..., G] (uint8, e8m0) as the values
    [..., G x 32] in ``dtype`` (float32 where None): each byte's low nibble, then its high one,
    times 2^(scale - 127)."""
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [..., G, 16] and [..., G]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).sub(127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype or torch.float32)


def read_mxfp4(read: RawRead, name: str, blocks_shape: tuple[int, ...],
               index: tuple[slice, ...] | None) -> torch.Tensor:
    """``name[index]`` in float32, ``name`` the tensor transformers' checkpoints hold (the
    transpose of the packed layout's last two dimensions: [..., G x 32, rows] for blocks
    [..., rows, G, 16]), reading only the groups that cover the index."""
    *lead, rows, groups, _ = blocks_shape
    shape = (*lead, groups * MXFP4_GROUP, rows)
    bounds = _bounds(index, shape)
    (k0, k1), (r0, r1) = bounds[-2], bounds[-1]
    g0, g1 = k0 // MXFP4_GROUP, math.ceil(k1 / MXFP4_GROUP)
    lead_index = tuple(slice(a, b) for a, b in bounds[:-2])
    packed = (*lead_index, slice(r0, r1), slice(g0, g1))
    values = dequantize_mxfp4(read(name + MXFP4_BLOCKS, packed), read(name + MXFP4_SCALES, packed))
    values = values[..., k0 - g0 * MXFP4_GROUP:k1 - g0 * MXFP4_GROUP]  # [..., rows, columns]
    return values.transpose(-1, -2)


class SafetensorsReader:
    """Reads tensors, or only some rows/columns of them, from an HF safetensors checkpoint;
    a checkpoint released quantized (``stored``: block FP8, MXFP4) is read dequantized, in
    float32, only the blocks and scales of the rows and columns asked for."""

    def __init__(self, hf_dir: str | Path, stored: CheckpointQuantization | None = None):
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: hf_dir / f for name, f in weight_map.items()}
        elif (hf_dir / "model.safetensors").is_file():
            with safe_open(hf_dir / "model.safetensors", "pt") as f:
                self.files = {name: hf_dir / "model.safetensors" for name in f.keys()}
        else:
            raise ValueError(f"model.path: no model.safetensors or model.safetensors.index.json in "
                             f"{hf_dir} (only safetensors checkpoints are read)")
        self.stored = stored
        self._handles: dict[Path, object] = {}
        self.read: set[str] = set()
        """The names read so far, a quantized weight's scales with it (``unread_layer_tensors``)."""

    def __call__(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        method = self.stored.method if self.stored is not None else None
        if method == "fp8" and name + FP8_SCALE_SUFFIX in self.files:
            return read_block_fp8(self._raw, name, self._slice(name).get_shape(),
                                  self._slice(name + FP8_SCALE_SUFFIX).get_shape(), index,
                                  self.stored.block)
        if method == "mxfp4" and name not in self.files and name + MXFP4_BLOCKS in self.files:
            return read_mxfp4(self._raw, name, self._slice(name + MXFP4_BLOCKS).get_shape(), index)
        if name not in self.files:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint")
        stored = self._slice(name).get_dtype()
        if stored.startswith("F8"):
            raise ValueError(
                f"tensor {name!r} is stored as {stored} with no {name}{FP8_SCALE_SUFFIX} beside it"
                + ("" if method == "fp8" else " and config.json has no quantization_config of "
                   "quant_method 'fp8'") + ": its values cannot be read")
        return self._raw(name, index)

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path]

    def _slice(self, name: str):
        return self._handle(name).get_slice(name)  # type: ignore[attr-defined]

    def _raw(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The stored tensor ``name`` (its ``index``), as the file holds it."""
        if name not in self.files:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint")
        self.read.add(name)
        if index is None:
            return self._handle(name).get_tensor(name)  # type: ignore[attr-defined]
        return self._slice(name)[index]

    def tensors(self):
        """(name, tensor) for every tensor of the checkpoint, one at a time, the quantized ones
        dequantized under the names an unquantized checkpoint gives them."""
        method = self.stored.method if self.stored is not None else None
        for name in self.files:
            if method == "fp8" and name.endswith(FP8_SCALE_SUFFIX):
                continue  # read with its weight
            if method == "mxfp4" and name.endswith(MXFP4_SCALES):
                continue
            if method == "mxfp4":
                name = name.removesuffix(MXFP4_BLOCKS)
            yield name, self(name, None)

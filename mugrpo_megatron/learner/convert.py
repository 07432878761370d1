"""Checkpoint conversion, both directions, in any TP/PP layout (launch through torchrun for N > 1).

- HF -> Megatron: each rank reads its shards from the safetensors files and the model is saved with
  megatron-core's distributed checkpointing (model only, ``checkpoint.save_checkpoint``), with the
  HF config and tokenizer files kept beside it under ``hf_config/`` so the checkpoint knows its
  architecture.
- Megatron -> HF: the model is loaded into the current layout and streamed out one tensor at a
  time as safetensors shards (see ``export.save_hf_checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from mugrpo_megatron.config import ModelConfig, ParallelConfig
from mugrpo_megatron.learner.checkpoint import (
    HF_CONFIG_DIR,
    load_model_state,
    model_sharded_state,
    save_checkpoint,
)
from mugrpo_megatron.learner.export import iter_hf_tensors, save_hf_checkpoint
from mugrpo_megatron.learner.model import build_chunks, init_parallel, load_hf_weights
from mugrpo_megatron.models.hf_config import read_model_spec

CONVERT_AGAIN = "run the conversion again"


def hf_to_megatron(hf_dir: Path, out: Path, parallel: ParallelConfig, dtype: str) -> None:
    """Collective. ``out`` is written whole beside itself and renamed into place (the caller
    checked the layout, ``layout.check_model``, and that ``out`` may be replaced:
    ``outputs.check_destination``)."""
    spec = read_model_spec(hf_dir)
    layout = init_parallel(parallel, seed=0)
    chunks = build_chunks(spec, ModelConfig(path=str(hf_dir), dtype=dtype), parallel)
    load_hf_weights(chunks, spec, hf_dir, layout.tp_rank, layout.tp_size)
    save_checkpoint(model_sharded_state(chunks), out, hf_source=hf_dir,
                    state={"model_only": True, "dtype": dtype}, then=CONVERT_AGAIN)


def megatron_to_hf(ckpt: Path, out: Path, parallel: ParallelConfig, dtype: str) -> None:
    """Collective; ``out`` is replaced as a whole once written (see ``export.save_hf_checkpoint``)."""
    hf_config = ckpt / HF_CONFIG_DIR
    if not (hf_config / "config.json").is_file():
        raise ValueError(f"--checkpoint: {ckpt} has no {HF_CONFIG_DIR}/config.json; it was not "
                         f"written by mugrpo_megatron, so its architecture is unknown")
    spec = read_model_spec(hf_config)
    init_parallel(parallel, seed=0)
    chunks = build_chunks(spec, ModelConfig(path=str(hf_config), dtype=dtype), parallel)
    load_model_state(chunks, ckpt)
    save_hf_checkpoint(iter_hf_tensors(chunks, spec), out, hf_config, write=dist.get_rank() == 0,
                       dtype=dtype, then=CONVERT_AGAIN)
    dist.barrier()

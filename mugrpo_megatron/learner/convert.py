"""Checkpoint conversion, both directions, in any TP/PP layout (launch through torchrun for N > 1).

- HF -> Megatron: each rank reads its shards from the safetensors files and the model is saved with
  megatron-core's distributed checkpointing (model only, ``checkpoint.save_checkpoint``), with the
  HF config and tokenizer files kept beside it under ``hf_config/`` so the checkpoint knows its
  architecture.
- Megatron -> HF: the model is loaded into the current layout and streamed out one tensor at a
  time as safetensors shards (see ``export.save_hf_checkpoint``).

``convert`` is the ``convert`` command: its checks run before megatron-core is imported (a few
seconds here) and before any process group exists; the conversions import it.
"""

from __future__ import annotations

import os
from pathlib import Path

from mugrpo_megatron import outputs
from mugrpo_megatron.config import ModelConfig, ParallelConfig
from mugrpo_megatron.layout import check_conversion
from mugrpo_megatron.models.hf_config import HF_CONFIG_DIR, read_model_spec

CONVERT_AGAIN = "run the conversion again"


def convert(to: str, source: str | None, out: str, *, tp: int, pp: int, ep: int, dtype: str,
            overwrite: bool) -> None:
    """``--to megatron`` from the HF checkpoint ``source`` or ``--to hf`` from a Megatron
    checkpoint of ours, into ``out``, with ``tp`` x ``pp`` x ``ep`` over the launch's ranks.
    ValueError, naming the flag, for a missing source, an architecture the layout does not fit
    (``layout.check_conversion``) or an ``out`` that is not ours to replace; then collective."""
    flag = "--hf-dir" if to == "megatron" else "--checkpoint"
    if not source:
        raise ValueError(f"--to {to} needs {flag}")
    if not Path(source).is_dir():
        raise ValueError(f"{flag}: {source} is not a directory")
    hf = Path(source) if to == "megatron" else Path(source) / HF_CONFIG_DIR
    if not (hf / "config.json").is_file():
        raise ValueError(f"{flag}: {source} has no {'' if to == 'megatron' else HF_CONFIG_DIR + '/'}"
                         f"config.json" + ("" if to == "megatron" else ": it was not written by "
                                           "mugrpo_megatron, so its architecture is unknown"))
    spec = read_model_spec(hf)
    parallel = check_conversion(spec, ModelConfig(path=str(hf), dtype=dtype), tp=tp, pp=pp, ep=ep,
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if parallel.sequence_parallel:
        print("note: sequence parallel on (megatron-core needs it for a mixture-of-experts model at "
              "--tp > 1; no weight depends on it)")
    outputs.check_destination(out, [source], overwrite=overwrite)
    if to == "megatron":
        hf_to_megatron(Path(source), Path(out), parallel, dtype)
    else:
        megatron_to_hf(Path(source), Path(out), parallel, dtype)
    import torch.distributed as dist

    if dist.is_initialized():
        # every rank is done (both end in a barrier): the groups go before the process does, so
        # that no gloo thread is left running at exit (a rank of a TP2 x PP2 conversion on a
        # loaded machine once aborted there: 'terminate called without an active exception')
        dist.destroy_process_group()


def hf_to_megatron(hf_dir: Path, out: Path, parallel: ParallelConfig, dtype: str) -> None:
    """Collective. ``out`` is written whole beside itself and renamed into place (the caller
    checked the layout, ``layout.check_model``, and that ``out`` may be replaced:
    ``outputs.check_destination``)."""
    from mugrpo_megatron.learner.checkpoint import model_sharded_state, save_checkpoint
    from mugrpo_megatron.learner.hf_weights import load_hf_weights
    from mugrpo_megatron.learner.model import build_chunks, init_parallel

    spec = read_model_spec(hf_dir)
    layout = init_parallel(parallel, seed=0)
    chunks = build_chunks(spec, ModelConfig(path=str(hf_dir), dtype=dtype), parallel)
    load_hf_weights(chunks, spec, hf_dir, layout.tp_rank, layout.tp_size)
    save_checkpoint(model_sharded_state(chunks), out, hf_source=hf_dir,
                    state={"model_only": True, "dtype": dtype}, then=CONVERT_AGAIN)


def megatron_to_hf(ckpt: Path, out: Path, parallel: ParallelConfig, dtype: str) -> None:
    """Collective; ``out`` is replaced as a whole once written (see ``export.save_hf_checkpoint``)."""
    import torch.distributed as dist

    from mugrpo_megatron.learner.checkpoint import load_model_state
    from mugrpo_megatron.learner.export import iter_hf_tensors, save_hf_checkpoint
    from mugrpo_megatron.learner.model import DTYPES, build_chunks, init_parallel

    hf_config = ckpt / HF_CONFIG_DIR
    if not (hf_config / "config.json").is_file():
        raise ValueError(f"--checkpoint: {ckpt} has no {HF_CONFIG_DIR}/config.json; it was not "
                         f"written by mugrpo_megatron, so its architecture is unknown")
    spec = read_model_spec(hf_config)
    init_parallel(parallel, seed=0)
    chunks = build_chunks(spec, ModelConfig(path=str(hf_config), dtype=dtype), parallel)
    load_model_state(chunks, ckpt)
    # every tensor in ``dtype``, as config.json will say (megatron keeps some, norms among
    # them, in float32)
    save_hf_checkpoint(iter_hf_tensors(chunks, spec, dtype=DTYPES[dtype]), out, hf_config,
                       write=dist.get_rank() == 0, dtype=dtype, then=CONVERT_AGAIN)
    dist.barrier()

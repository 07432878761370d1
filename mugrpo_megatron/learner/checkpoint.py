"""Learner checkpoints with megatron-core's distributed checkpointing.

Model and optimizer state are saved as sharded tensors (``torch_dist`` format) so that a run can
resume with another TP/PP/DP layout. The distributed optimizer saves in megatron-core's
"fully_sharded_model_space" layout (``OPTIMIZER_FORMAT``; megatron refuses its flattened ranges
today, ``compat_megatron`` part 5 describes them as rectangles): each rank writes its own slice of
each parameter's fp32 master copy and Adam moments, in model space, so any layout reads it back.
Its "fully_reshardable" layout, used before, gathers every rank's whole TP x PP shard of that
state in host memory (12 bytes a parameter of the shard: ~27 GB a rank at 70B on TP8 x PP4,
~55 GiB with the copies around it, on every rank at once); here a save's extra host memory is the
rank's own shard, which megatron's writer stages in host memory before it writes (both
0.16.1 and 0.19.2). Checkpoints saved in the old layout still load (``state.json`` names the
layout; absent means the old one). The LR scheduler, the phase/update counters and the RNG state go to a
small JSON file (no pickles of ours). A checkpoint directory is complete once ``state.json``
exists: it is written last, after every rank finished writing tensors, and the directory is
renamed into place only then. Every load first checks the directory (``compat_dcp``): complete,
not truncated, and no pickle in it that could run code.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mugrpo_megatron.learner.compat_megatron import (
    checkpoint_writers_die_with_us,
    ensure_optimizer_state,
    has_optimizer_state,
    megatron_on_cpu,
    optimizer_state_in_model_space,
    tolerate_missing_step,
    unshare_steps,
)

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from mugrpo_megatron import outputs
from mugrpo_megatron.distributed import on_rank0
from mugrpo_megatron.learner.compat_dcp import verify_checkpoint
from mugrpo_megatron.learner.export import copy_tokenizer
from mugrpo_megatron.learner.fp8 import own_fp8_state_loadable
from mugrpo_megatron.models.hf_config import HF_CONFIG_DIR

OPTIMIZER_FORMAT = "fully_sharded_model_space"
"""The distributed optimizer's checkpoint layout for new saves (see the module docstring)."""
_LEGACY_FORMAT = "fully_reshardable"
"""What checkpoints without an 'optimizer_format' in state.json were saved in."""
STATE_FILE = "state.json"
"""Counters, LR schedule and flags; written last, so its presence marks a complete checkpoint."""


def model_sharded_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The model part of a checkpoint: one sharded state dict per bare GPTModel chunk (so tensor
    keys do not depend on the DDP/fp16 wrappers)."""
    return {_model_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}


def load_model_state(chunks: list[torch.nn.Module], path: Path) -> None:
    """Load the model part of a Megatron checkpoint (full or model-only) into ``chunks``."""
    _verified(path)
    _load_model(chunks, path)


def _load_model(chunks: list[torch.nn.Module], path: Path) -> None:
    with megatron_on_cpu(), own_fp8_state_loadable():
        loaded = dist_checkpointing.load(model_sharded_state(chunks), str(path))
        for i, c in enumerate(chunks):
            c.load_state_dict(loaded[_model_key(i, len(chunks))])


def _opt_metadata(optimizer_format: str) -> dict[str, str]:
    return {"distrib_optim_sharding_type": optimizer_format}


def _sharded_state(learner, loading: bool, with_optimizer: bool = True,
                   optimizer_format: str = OPTIMIZER_FORMAT) -> dict[str, Any]:
    chunks = learner.chunks()
    state = model_sharded_state(chunks)
    model_state = state["model"] if len(chunks) == 1 else dict(state)
    if with_optimizer:
        with optimizer_state_in_model_space():
            state["optimizer"] = learner.optimizer.sharded_state_dict(
                model_state, is_loading=loading, metadata=_opt_metadata(optimizer_format))
    return state


def _load_model_only(learner, path: Path) -> None:
    """The model from a checkpoint without optimizer state; a fresh optimizer's fp32 master
    copies follow the loaded weights (``path`` is verified)."""
    _load_model(learner.chunks(), path)
    if hasattr(learner.optimizer, "reload_model_params"):
        learner.optimizer.reload_model_params()


def _has_optimizer_state(optimizer) -> bool:
    """Whether the optimizer has state on every rank (none before the first update: see
    ``compat_megatron.has_optimizer_state``), so that all ranks save the same thing."""
    flag = torch.tensor([1 if has_optimizer_state(optimizer) else 0],
                        device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def save_learner(learner, path: Path, counters: dict,
                 optimizer_format: str = OPTIMIZER_FORMAT) -> None:
    """Collective: every rank writes its shards, rank 0 the small state last (see
    save_checkpoint). ``optimizer_format``: another of megatron's layouts, for comparisons."""
    with_optimizer = _has_optimizer_state(learner.optimizer)
    with megatron_on_cpu():
        state = _sharded_state(learner, loading=False, with_optimizer=with_optimizer,
                               optimizer_format=optimizer_format)
    save_checkpoint(state, path,
                    hf_source=learner.hf_dir, state={
                        "counters": counters,
                        "scheduler": learner.scheduler.state_dict(),
                        "num_updates": learner.num_updates,
                        "distributed_optimizer": learner.parallel.distributed_optimizer,
                        "optimizer_state": with_optimizer,
                        "optimizer_format": optimizer_format,
                    }, content_metadata=_opt_metadata(optimizer_format))


def save_checkpoint(sharded_state: dict[str, Any], path: Path, *, hf_source: Path,
                    state: dict[str, Any], content_metadata: dict[str, str] | None = None,
                    then: str = outputs.RESUME) -> None:
    """The one way a checkpoint is written (learner saves and ``convert --to megatron``).

    Collective: every rank writes its shards into a staging directory beside ``path``; after a
    barrier rank 0 adds the HF config and tokenizer (``hf_config/``) and ``state.json`` (the
    completion marker, written last), then renames the directory into place, replacing what was
    there. A crash at any point leaves ``path`` as it was: never a half-written checkpoint that
    looks complete.

    Space: the ranks first add up what they will write (one integer); rank 0 refuses to start
    when its file system has less free, and a write that runs out of space anyway (a quota
    below the free space) is a ``DiskFull`` error naming the path, the space and what to do
    (``then``), after the partial staging directory is removed. Every rank raises either."""
    path = Path(path)
    tmp = outputs.staging_path(path)
    what = f"checkpoint {path.name}"
    kept = f"{outputs.KEPT}; the partial checkpoint was removed"
    needed = torch.tensor(_bytes_to_write(sharded_state), dtype=torch.int64,
                          device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(needed)
    on_rank0(_begin, path, int(needed), what, kept, then)
    checkpoint_writers_die_with_us()
    try:
        with outputs.guard(tmp, what, kept=kept, then=then), megatron_on_cpu():
            dist_checkpointing.save(sharded_state, str(tmp), content_metadata=(
                content_metadata or _opt_metadata(OPTIMIZER_FORMAT)))
        dist.barrier()

        def finish() -> None:
            with outputs.guard(tmp, what, kept=kept, then=then):
                keep_hf_config(hf_source, tmp)
                outputs.write_file(tmp / STATE_FILE, json.dumps(state, indent=1))
                outputs.commit(path, tmp)

        on_rank0(finish)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # ours, partial: give its space back
        raise


def _bytes_to_write(sharded_state: dict[str, Any]) -> int:
    """What this rank writes of a sharded state: the tensors (and factories) it holds the main
    replica of. The sum over ranks is the checkpoint's size."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    total = 0
    for value in nested_values(sharded_state):
        data = getattr(value, "data", None)
        if torch.is_tensor(data) and is_main_replica(getattr(value, "replica_id", 0)):
            total += data.numel() * data.element_size()
    return total


def _begin(path: Path, needed: int, what: str, kept: str, then: str) -> None:
    """Rank 0: a fresh staging directory, once the file system has room for ``needed`` bytes."""
    if outputs.free_bytes(path) < needed:
        raise outputs.disk_full(outputs.staging_path(path), what, None, kept=kept, then=then,
                                needed=needed)
    with outputs.guard(path, what, kept=kept, then=then):
        outputs.begin(path)


def keep_hf_config(source: Path, ckpt: Path) -> None:
    """Copy config.json and tokenizer files into ``ckpt/hf_config`` (rank 0 only), so the
    checkpoint knows its architecture."""
    out = ckpt / HF_CONFIG_DIR
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "config.json", out / "config.json")
    copy_tokenizer(source, out)


def load_learner(learner, path: Path) -> dict:
    """Restore model, optimizer and scheduler (any layout); returns the saved counters."""
    path = Path(path)
    _verified(path)
    meta = json.loads((path / STATE_FILE).read_text())
    if meta.get("model_only"):
        _load_model_only(learner, path)
        return {"update": 0, "phase": 0}
    saved_distopt = meta.get("distributed_optimizer")
    if saved_distopt is not None and saved_distopt != learner.parallel.distributed_optimizer:
        raise ValueError(
            f"parallel.distributed_optimizer: the checkpoint {path} was saved with "
            f"{saved_distopt}, this run has {learner.parallel.distributed_optimizer}; "
            f"TP/PP/DP sizes may change on resume, this setting may not")
    if not meta.get("optimizer_state", True):  # saved before the first update
        _load_model_only(learner, path)
    else:
        ensure_optimizer_state(learner.optimizer)
        tolerate_missing_step(learner.optimizer)
        saved_format = meta.get("optimizer_format", _LEGACY_FORMAT)
        with megatron_on_cpu(), own_fp8_state_loadable():
            state = dist_checkpointing.load(
                _sharded_state(learner, loading=True, optimizer_format=saved_format), str(path))
            chunks = learner.chunks()
            for i, chunk in enumerate(chunks):
                chunk.load_state_dict(state[_model_key(i, len(chunks))])
            learner.optimizer.load_state_dict(state["optimizer"])
        unshare_steps(learner.optimizer)
    learner.scheduler.load_state_dict(meta["scheduler"])
    learner.num_updates = meta["num_updates"]
    return meta["counters"]


def _verified(path: Path) -> None:
    problem = verify_checkpoint(path)
    if problem:
        raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")


def is_complete(path: Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def usable_checkpoint(root: Path, note: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under ``root`` (``update_0000128`` style names) that is complete and
    passes ``verify_checkpoint``; each newer one that does not is named through ``note`` with its
    problem, and the previous one is tried."""
    if not Path(root).is_dir():
        return None
    for path in sorted(Path(root).glob("update_*"), reverse=True):
        problem = verify_checkpoint(path)
        if not problem:
            return path
        note(f"checkpoint {path} is unusable ({problem}); falling back to the one before it")
    return None


def prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in Path(root).glob("update_*") if is_complete(p))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)



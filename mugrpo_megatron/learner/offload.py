"""Moving the learner's memory to the host while the rollout engine generates, and back.

Mu-GRPO alternates a generation stage and an optimization stage, so the learner's weights,
gradient buffers and optimizer state need not sit in accelerator memory while the engine samples.
``HostOffload`` frees them there and restores them, bit for bit, before the next update.

It works on storages, not on tensors. Megatron's model is a web of views: DDP keeps parameters
and gradients inside contiguous buffers (``param_data``, ``grad_data``; ``param.main_grad`` is a
view into the latter), and the distributed optimizer's fp32 shards are views into the parameters.
Copying each storage's bytes to the host and shrinking the storage to 0 bytes frees the memory
while every view keeps pointing at the same storage object; growing it back and copying the bytes
in restores all of them at once. megatron-core 0.16 has its own helpers
(``DistributedDataParallel.offload_grad_buffers``, ``MegatronOptimizer.offload_to_cpu``), but the
optimizer's rebinds ``p.data`` to a new tensor, which detaches the distributed optimizer's fp32
shards from the parameters they are views of, and both do nothing unless tensors are on CUDA; this
module is written here for those two reasons, and is the same code on CPU, where it is tested.

Gradient buffers are not copied: they are zeroed before every update, so they are only freed and
come back as zeros.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mugrpo_megatron.learner.compat_megatron import inner_optimizers

import torch


@dataclass(frozen=True)
class OffloadStats:
    """What one offload or onload moved."""

    bytes_copied: int
    """Bytes copied between accelerator and host (weights, master weights, optimizer state)."""
    bytes_freed: int
    """Accelerator bytes released by an offload or re-allocated by an onload (copied + gradients)."""
    seconds: float
    """Wall time, including the device synchronisation."""


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Frees and restores the accelerator memory of a learner's model chunks and optimizer.

    The storages are collected at each offload (Adam's state appears at the first update); the
    host buffers are kept between phases, pinned on CUDA, and reused by size."""

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer) -> None:
        self._chunks = model_chunks
        self._optimizer = optimizer
        self._moved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        self._pool: dict[int, list[torch.Tensor]] = {}
        self.offloaded = False

    def _storages(self) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
        """(storages to copy and restore, storages only to free and zero), each once."""
        keep: dict[int, torch.UntypedStorage] = {}
        drop: dict[int, torch.UntypedStorage] = {}

        def add(into: dict, tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                into.setdefault(storage.data_ptr(), storage)

        for chunk in self._chunks:
            for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                if buffer.grad_data is not None:
                    add(drop, buffer.grad_data)
                if buffer.param_data is not None:
                    add(keep, buffer.param_data)
            for p in chunk.parameters():
                add(keep, p)
        for inner in _torch_optimizers(self._optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    add(keep, p)
            for state in inner.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        add(keep, v)
        # a storage that holds both parameters and gradients must be kept
        return list(keep.values()), [s for k, s in drop.items() if k not in keep]

    def resident_bytes(self) -> int:
        """Bytes of the learner's storages currently allocated on its device."""
        keep, drop = self._storages()
        return sum(s.nbytes() for s in keep + drop)

    def offload(self) -> OffloadStats:
        """Copy weights and optimizer state to the host, then free every storage on the device."""
        if self.offloaded:
            raise RuntimeError("the learner is already offloaded")
        t0 = time.perf_counter()
        keep, drop = self._storages()
        copied = 0
        for storage in keep:
            src = _as_bytes(storage)
            free = self._pool.get(src.numel())
            host = free.pop() if free else torch.empty(src.numel(), dtype=torch.uint8,
                                                        pin_memory=src.is_cuda)
            host.copy_(src, non_blocking=True)
            copied += src.numel()
            self._moved.append((storage, src.numel(), host))
        self._moved += [(s, s.nbytes(), None) for s in drop]
        _synchronize()
        freed = 0
        for storage, nbytes, _ in self._moved:
            storage.resize_(0)
            freed += nbytes
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.offloaded = True
        return OffloadStats(copied, freed, time.perf_counter() - t0)

    def onload(self) -> OffloadStats:
        """Re-allocate every storage on the device and copy the host bytes back in."""
        if not self.offloaded:
            raise RuntimeError("the learner is not offloaded")
        t0 = time.perf_counter()
        copied = 0
        for storage, nbytes, host in self._moved:
            storage.resize_(nbytes)
            if host is None:
                _as_bytes(storage).zero_()
            else:
                _as_bytes(storage).copy_(host, non_blocking=True)
                copied += nbytes
        _synchronize()
        for _, nbytes, host in self._moved:
            if host is not None:
                self._pool.setdefault(nbytes, []).append(host)
        allocated = sum(n for _, n, _ in self._moved)
        self._moved = []
        self.offloaded = False
        return OffloadStats(copied, allocated, time.perf_counter() - t0)


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (chained) optimizer."""
    return [w.optimizer for w in inner_optimizers(optimizer)
            if getattr(w, "optimizer", None) is not None]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()

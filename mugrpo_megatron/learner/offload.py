"""Moving the learner's memory to the host while the rollout engine works, and back.

Mu-GRPO alternates a generation stage and an optimization stage, so the learner's weights,
gradient buffers and optimizer state need not sit in accelerator memory while the engine samples.
``HostOffload`` frees them there before the engine's weights wake for a sync, and restores them,
bit for bit, before the next update. A sync in between reads each weight from the host copy
(``host_tensor``), so the engine's woken weights never sit beside the learner's: at DeepSeek-V3's
config that is the 8.7 GiB of a rank's weights less at the sync. (It used to go in two steps,
the weights kept on the device for the sync; slime streams from the host copy too.)

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

Host memory: pinned (on CUDA) in chunks of ``HOST_CHUNK`` bytes, a power of two, which every
storage's bytes are laid across (``HostPool``). torch's caching host allocator rounds each pinned
allocation up to a power of two (``CachingHostAllocator::allocate``, torch 2.13/2.14: ``roundSize
= PowerOf2Ceil(size)`` below ``pinned_max_round_threshold``, unbounded by default): one buffer a
storage made DDP's 4.5 GB ``param_data`` at 70B an 8 GiB block, 1.3-1.9x the state in all. Chunks
of a power of two waste less than one chunk a rank.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from mugrpo_megatron.learner.compat_megatron import inner_optimizers

import torch

HOST_CHUNK = 1 << 28
"""Bytes of one pinned host chunk (256 MiB: a power of two, so the host allocator rounds
nothing; a rank's offload wastes less than one)."""


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


class HostPool:
    """Host memory for offloaded storages, in chunks of ``chunk`` bytes (pinned where the
    storages are on CUDA), kept between phases and reused in the same order; a storage's bytes
    may span chunks. ``requested`` lists every allocation's size, as the host allocator sees
    them (the dry run's host figure follows the same rule)."""

    def __init__(self, chunk: int = HOST_CHUNK):
        self.chunk = chunk
        self.chunks: list[torch.Tensor] = []
        self.requested: list[int] = []

    def place(self, sizes: list[int], pin: bool) -> list[list[tuple[int, int, int]]]:
        """Where each of ``sizes`` bytes goes: for each, pieces (chunk, offset in the chunk,
        length), laid end to end from the pool's first chunk; chunks are added as needed."""
        out, at = [], 0
        for size in sizes:
            pieces, left = [], size
            while left:
                index, offset = divmod(at, self.chunk)
                length = min(left, self.chunk - offset)
                pieces.append((index, offset, length))
                at, left = at + length, left - length
            out.append(pieces)
        while len(self.chunks) * self.chunk < at:
            self.requested.append(self.chunk)
            self.chunks.append(torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pin))
        return out

    @property
    def nbytes(self) -> int:
        return len(self.chunks) * self.chunk


class HostOffload:
    """Frees and restores the accelerator memory of a learner's model chunks and optimizer.

    The storages are collected at each offload (Adam's state appears at the first update)."""

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer,
                 chunk: int = HOST_CHUNK) -> None:
        self._chunks = model_chunks
        self._optimizer = optimizer
        self._moved: list[tuple[torch.UntypedStorage, int, list | None]] = []
        self._on_host: dict[int, tuple[list, int, torch.Tensor]] = {}
        """Each model parameter whose weights are on the host: id -> (its storage's pieces,
        its first byte in the storage, itself), for ``host_tensor``."""
        self.pool = HostPool(chunk)
        self.state = "device"
        """'device' (everything on the accelerator) or 'host' (nothing there)."""

    @property
    def offloaded(self) -> bool:
        return self.state != "device"

    def _storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """The storages of each kind, each once: 'weights' (the model's parameters and DDP's
        parameter buffers), 'optimizer' (master weights and optimizer state that are not
        weights), 'grads' (gradient buffers that are neither)."""
        kinds: dict[str, dict[int, torch.UntypedStorage]] = {"weights": {}, "optimizer": {},
                                                              "grads": {}}

        def add(kind: str, tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                kinds[kind].setdefault(storage.data_ptr(), storage)

        for chunk in self._chunks:
            for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                if buffer.grad_data is not None:
                    add("grads", buffer.grad_data)
                if buffer.param_data is not None:
                    add("weights", buffer.param_data)
            for p in chunk.parameters():
                add("weights", p)
        for inner in _torch_optimizers(self._optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    add("optimizer", p)
            for state in inner.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        add("optimizer", v)
        weights = kinds["weights"]
        optimizer = {k: s for k, s in kinds["optimizer"].items() if k not in weights}
        grads = {k: s for k, s in kinds["grads"].items() if k not in weights and k not in optimizer}
        return {"weights": list(weights.values()), "optimizer": list(optimizer.values()),
                "grads": list(grads.values())}

    def resident_bytes(self) -> int:
        """Bytes of the learner's storages currently allocated on its device."""
        return sum(s.nbytes() for kind in self._storages().values() for s in kind)

    def offload(self) -> OffloadStats:
        """Free the gradient buffers and copy the optimizer's state and the weights to the host
        (each weight's place noted for ``host_tensor``)."""
        if self.state == "host":
            raise RuntimeError("the learner is already offloaded")
        t0 = time.perf_counter()
        kinds = self._storages()
        keep, drop = kinds["optimizer"] + kinds["weights"], kinds["grads"]
        placed = self._place([s.nbytes() for s in keep],
                             pin=any(s.device.type == "cuda" for s in keep))
        new = []
        for storage, pieces in zip(keep, placed):
            src = _as_bytes(storage)
            for index, offset, length, start in pieces:
                self.pool.chunks[index][offset:offset + length].copy_(
                    src[start:start + length], non_blocking=True)
            new.append((storage, src.numel(), pieces))
        new += [(s, s.nbytes(), None) for s in drop]
        self._note_parameters(new)
        _synchronize()
        for storage, _, _ in new:
            storage.resize_(0)
        self._moved = new
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.state = "host"
        return OffloadStats(sum(n for _, n, p in new if p is not None),
                            sum(n for _, n, _ in new), time.perf_counter() - t0)

    def _note_parameters(self, moved: list[tuple[torch.UntypedStorage, int, list | None]]) -> None:
        """Where each model parameter's bytes go on the host (before its storage is freed)."""
        pieces_at = {storage.data_ptr(): pieces for storage, _, pieces in moved
                     if pieces is not None}
        for chunk in self._chunks:
            for param in chunk.parameters():
                pieces = pieces_at.get(param.untyped_storage().data_ptr())
                if pieces is not None and param.is_contiguous():
                    start = param.storage_offset() * param.element_size()
                    self._on_host[id(param)] = (pieces, start, param)

    def host_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s values as the host copy holds them while the learner is offloaded (the
        weights too): a tensor on the host of its dtype and shape, a view into the pinned
        chunk where its bytes lie in one (no copy), else assembled from the pieces. What a
        weight sync streams from, so that the learner's weights need not be on the device
        beside the engine's (``handoff``); a caller moves it to the device one tensor at a
        time."""
        if self.state != "host" or id(param) not in self._on_host:
            raise RuntimeError(f"host_tensor: this parameter is not in the learner's host copy "
                               f"(the learner's state is {self.state!r})")
        pieces, start, _ = self._on_host[id(param)]
        nbytes = param.numel() * param.element_size()
        parts = []
        for index, offset, length, at in pieces:  # the pieces overlapping [start, start + n)
            lo, hi = max(start, at), min(start + nbytes, at + length)
            if lo < hi:
                parts.append(self.pool.chunks[index][offset + lo - at:offset + hi - at])
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        if flat.storage_offset() % param.element_size():  # not aligned for a view: copy
            flat = flat.clone()
        return flat.view(param.dtype).view(param.shape)

    def _place(self, sizes: list[int], pin: bool) -> list[list[tuple[int, int, int, int]]]:
        """Pool pieces (chunk, offset, length, start in the storage) for storages of ``sizes``."""
        return _with_starts(self.pool.place(sizes, pin=pin))

    def onload(self) -> OffloadStats:
        """Re-allocate every storage on the device and copy the host bytes back in."""
        if not self.offloaded:
            raise RuntimeError("the learner is not offloaded")
        t0 = time.perf_counter()
        copied = 0
        for storage, nbytes, pieces in self._moved:
            storage.resize_(nbytes)
            dst = _as_bytes(storage)
            if pieces is None:
                dst.zero_()
                continue
            for index, offset, length, start in pieces:
                dst[start:start + length].copy_(self.pool.chunks[index][offset:offset + length],
                                                non_blocking=True)
            copied += nbytes
        _synchronize()
        allocated = sum(n for _, n, _ in self._moved)
        self._moved = []
        self._on_host = {}
        self.state = "device"
        return OffloadStats(copied, allocated, time.perf_counter() - t0)


def _with_starts(placed: list[list[tuple[int, int, int]]]) -> list[list[tuple[int, int, int, int]]]:
    """``HostPool.place``'s pieces of each storage with where each begins in the storage."""
    out = []
    for pieces in placed:
        start, with_start = 0, []
        for index, offset, length in pieces:
            with_start.append((index, offset, length, start))
            start += length
        out.append(with_start)
    return out


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (chained) optimizer."""
    return [w.optimizer for w in inner_optimizers(optimizer)
            if getattr(w, "optimizer", None) is not None]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ReferenceWeights:
    """The learner's weights as they were when this was made (the run's starting policy, for
    ``algo.kl_target: reference``), kept in host memory, and swapped into the model for a pass.

    A copy of every weight storage's bytes (``HostOffload``'s 'weights': the parameters and
    DDP's parameter buffers, this rank's shards only) in a ``HostPool`` of its own: pinned on
    CUDA, the learner's weight bytes a rank (4.4 GB at the 70B config: 35 GB a node). ``swapped_in``
    puts them in place of the learner's for a forward pass and back after, bit for bit:

    - the learner offloaded ('host': as it is after a phase's generation), its storages are
      grown back, filled with the reference and freed again: the learner's own weights wait in
      the offload's host copy, and the device holds one copy of the weights, as at a sync;
    - the learner on the device, its weights are first copied into a second host pool (a
      resumed phase's pass takes this path), then back, and that pool is let go.

    No optimizer state is touched: the pass is a forward pass only, between updates."""

    def __init__(self, host: HostOffload, chunk: int = HOST_CHUNK):
        if host.state != "device":
            raise RuntimeError("the reference is taken from the learner's weights on the device")
        self._host = host
        self._storages = [(s, s.nbytes()) for s in host._storages()["weights"]]
        cuda = any(s.device.type == "cuda" for s, _ in self._storages)
        self.pool = HostPool(chunk)
        self._pieces = self._placed(self.pool, cuda)
        self._fill(self.pool, self._pieces, to_host=True)
        self._stash: HostPool | None = None
        self._stash_pieces: list = []
        self._cuda = cuda
        self.swaps = 0
        """Times the reference was swapped in (each a copy of the weights both ways)."""

    @property
    def nbytes(self) -> int:
        """Host bytes the reference holds (its pool's chunks)."""
        return self.pool.nbytes

    @property
    def held_bytes(self) -> int:
        """Host bytes held now: the reference's, and during a swap with the learner on the
        device, the learner's own weights waiting in a second pool."""
        return self.pool.nbytes + (self._stash.nbytes if self._stash is not None else 0)

    def _placed(self, pool: HostPool, pin: bool) -> list[list[tuple[int, int, int, int]]]:
        return _with_starts(pool.place([n for _, n in self._storages], pin=pin))

    @staticmethod
    def _copy(flat: torch.Tensor, pieces, to_host: bool, chunks: list[torch.Tensor]) -> None:
        for index, offset, length, start in pieces:
            host = chunks[index][offset:offset + length]
            if to_host:
                host.copy_(flat[start:start + length], non_blocking=True)
            else:
                flat[start:start + length].copy_(host, non_blocking=True)

    def _fill(self, pool: HostPool, pieces_of, to_host: bool) -> None:
        for (storage, _), pieces in zip(self._storages, pieces_of):
            self._copy(_as_bytes(storage), pieces, to_host, chunks=pool.chunks)
        _synchronize()

    @contextlib.contextmanager
    def swapped_in(self):
        """Context: the reference's weights in the model inside, the learner's own after."""
        self.swaps += 1
        offloaded = self._host.state == "host"
        if offloaded:
            for storage, nbytes in self._storages:
                storage.resize_(nbytes)
        else:
            if self._stash is None:
                self._stash = HostPool(self.pool.chunk)
                self._stash_pieces = self._placed(self._stash, self._cuda)
            self._fill(self._stash, self._stash_pieces, to_host=True)
        self._fill(self.pool, self._pieces, to_host=False)
        try:
            yield
        finally:
            if offloaded:
                for storage, _ in self._storages:
                    storage.resize_(0)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            else:
                self._fill(self._stash, self._stash_pieces, to_host=False)
                # let the stash go: pinned, it would hold the learner's weight bytes a rank
                # (4.4 GB at the 70B config, 35 GB a node) for the rest of the run
                self._stash, self._stash_pieces = None, []

"""Run megatron-core on a CPU over gloo: stand-ins for the CUDA calls it makes unconditionally.

Used only when CUDA is absent (CI, laptops): ``megatron_on_cpu()`` is a no-op context where
``torch.cuda.is_available()``. Inside it, and only there, each line below stands in for one
megatron-core call (checked against megatron-core 0.16.1; 0.17-0.19 make the same calls):

- ``torch.cuda.current_device()`` (rotary embeddings, TP layers, p2p shape tensors, DDP buffers,
  distributed optimizer) -> the CPU device.
- ``torch.cuda.synchronize()`` (``pipeline_parallel/p2p_communication.py``) -> no-op; gloo ops are
  synchronous.
- ``torch.cuda.get_rng_state()`` / ``torch.cuda.manual_seed()`` / ``torch.cuda.set_rng_state`` in
  ``tensor_parallel/random.py`` (``CudaRNGStatesTracker.add``, ``_get_cuda_rng_state``,
  ``_set_cuda_rng_state``, ``model_parallel_cuda_manual_seed``) -> the CPU generator, so the
  model-parallel RNG tracker forks and restores CPU states instead.
- ``device="cuda"`` / ``device=<int>`` in tensor factories (``schedules.py`` token counts,
  ``optimizer.py`` found-inf and scale buffers, ``clip_grads.py`` norms) -> ``device="cpu"``, by a
  ``TorchFunctionMode`` active only inside the context.
- ``Tensor.cuda()`` (optimizer state reload) -> the tensor itself.
- ``Tensor.type()`` compared with ``'torch.cuda.FloatTensor'`` and friends
  (``optimizer/distrib_optimizer.py``, ``optimizer/optimizer.py``, ``clip_grads.py``) -> the CUDA
  spelling of the CPU tensor's type.

Sequence parallel with megatron's torch norms needs no stand-in here; the learner tags the norm
weights ``sequence_parallel`` itself (see ``model.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.RLock()
_depth = 0
_saved: dict[str, object] = {}


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name.count(".") == 1 else name
        if func is torch.Tensor.to and args[1:] and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _patch() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    stand_ins = {
        ("cuda", "current_device"): lambda: _CPU,
        ("cuda", "synchronize"): lambda *a, **k: None,
        ("cuda", "get_rng_state"): lambda *a, **k: torch.get_rng_state(),
        ("cuda", "manual_seed"): lambda seed: torch.manual_seed(seed),
        ("random", "_get_cuda_rng_state"): lambda *a, **k: torch.get_rng_state(),
        ("random", "_set_cuda_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
    }
    owners = {"cuda": torch.cuda, "random": mrandom}
    for (owner, name), fn in stand_ins.items():
        _saved[f"{owner}.{name}"] = getattr(owners[owner], name)
        setattr(owners[owner], name, fn)


def _unpatch() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    owners = {"cuda": torch.cuda, "random": mrandom}
    for key, fn in _saved.items():
        owner, name = key.split(".")
        setattr(owners[owner], name, fn)
    _saved.clear()


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Make megatron-core's CUDA calls run on the CPU for the duration (re-entrant)."""
    global _depth
    if torch.cuda.is_available():
        yield
        return
    with _lock:
        if _depth == 0:
            _patch()
        _depth += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _unpatch()

"""Transformer Engine: whether the learner runs it, and FP8 training through it (the checks and
megatron-core ``TransformerConfig`` fields of ``model.fp8_format`` / ``fp8_recipe``).

TE is imported here only (``transformer_engine_ready``), and only on a GPU. Formats: 'e4m3' everywhere, or
'hybrid' (e4m3 forward, e5m2 gradients). Recipes: 'delayed' (amax history), 'tensorwise'
(current per-tensor scaling), 'blockwise' and 'mxfp8' (need a TE that has them; mxfp8 needs
Blackwell). The shapes an FP8 GEMM accepts are the layout's rules (``layout.shapes``).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from typing import Any

import torch

from mugrpo_megatron.config import ModelConfig

# What the FP8 guard reads of TE (scripts/check_upstream.py checks each in TE's released source at
# both ends of pyproject's range, and the versioned ones present exactly where their range says)
UPSTREAM_SYMBOLS: tuple[str, ...] = (
    "transformer_engine.pytorch.quantization:FP8GlobalStateManager",
    "transformer_engine.pytorch.quantization:FP8GlobalStateManager.split_key_in_buffer",
)
UPSTREAM_VERSIONED: dict[str, str] = {
    # the delayed-scaling amax buffer: a class attribute of the manager up to 2.14, a field of
    # its quantization_state (an FP8GlobalState, replaced whole by reset()) from 2.15
    "transformer_engine.pytorch.quantization:FP8GlobalStateManager.global_amax_buffer": "<2.15",
    "transformer_engine.pytorch.quantization:FP8GlobalStateManager.quantization_state": ">=2.15",
    "transformer_engine.pytorch.quantization:FP8GlobalState.global_amax_buffer": ">=2.15",
    # set_extra_state refuses a pickled delayed-scaling state unless this variable is "1"
    "transformer_engine.pytorch._extra_state:UNSAFE_PICKLE_EXTRA_STATE_ENV": ">=2.17",
}
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
"""TE's ``UNSAFE_PICKLE_EXTRA_STATE_ENV`` (2.17-2.20 ``pytorch/_extra_state.py``)."""

_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


TE_BROKEN = (
    "Transformer Engine is installed but its PyTorch part does not import ({}). Its "
    "transformer_engine_torch package is a source distribution compiled at install: installed "
    "without --no-build-isolation it is built against the newest torch in pip's build "
    "environment instead of the installed one, and fails to load. Reinstall it against this "
    "environment's torch (README, 'Running on GPUs': pip install --no-build-isolation "
    "'transformer-engine[pytorch]...'), or uninstall transformer-engine to train without it "
    "(megatron's local layers: no FP8, no packing through THD).")


def transformer_engine_ready() -> bool:
    """Whether the learner runs Transformer Engine's layers: on a GPU where TE's PyTorch part
    imports. False without a GPU or without TE; ValueError (``TE_BROKEN``) where TE is installed
    and ``transformer_engine.pytorch`` fails to import: ``import transformer_engine`` alone
    succeeds then (its top-level package swallows the PyTorch part's ImportError, TE 2.x), and
    megatron-core's TE spec would die later with ``NameError: TESpecProvider``."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError) as e:
        raise ValueError(TE_BROKEN.format(f"{type(e).__name__}: {e}")) from None
    return True


def fp8_kwargs(model: ModelConfig) -> dict[str, Any]:
    """megatron-core FP8 options for ``model.fp8_format``/``fp8_recipe``; ValueError when the
    machine cannot run them."""
    if not torch.cuda.is_available():
        raise ValueError(f"model.fp8_format: FP8 training needs a CUDA GPU, and none is visible "
                         f"(got {model.fp8_format!r})")
    if not transformer_engine_ready():
        raise ValueError("model.fp8_format: FP8 training needs Transformer Engine, which is not "
                         "installed (README, 'Running on GPUs')")
    need = _MIN_CAPABILITY[model.fp8_recipe]
    have = torch.cuda.get_device_capability()
    if have < need:
        raise ValueError(f"model.fp8_recipe: {model.fp8_recipe!r} needs compute capability "
                         f"{need[0]}.{need[1]} or newer; this GPU has {have[0]}.{have[1]}")
    # tp_only_amax_red stays off (megatron's default): the amax is reduced over TP x DP, so
    # every data-parallel replica quantizes with the same scales, and a checkpoint's FP8 state
    # (one replica's, TP rank 0 / DP rank 0 of the layer's stage, restored on every rank of any
    # layout a resume uses: tests/test_fp8.py) is every replica's. It costs an all-reduce of a
    # few KB across DP per microbatch, which every DP rank joins as often as the others because each
    # runs as many microbatches (Learner._equal_count); that rule is needed anyway for MoE
    # dispatch and context parallelism, so reducing over TP only would buy no safety.
    return {"fp8": model.fp8_format, "fp8_recipe": model.fp8_recipe, "fp8_margin": 0,
            "fp8_amax_history_len": 1024 if model.fp8_recipe == "delayed" else 1,
            "fp8_amax_compute_algo": "max", "tp_only_amax_red": False}


@contextmanager
def forward_amaxes_kept(delayed: bool, manager=None):
    """A no-grad pass under FP8 delayed scaling that leaves the next update's scaling as it
    would be without it. TE's casts fold every forward tensor's amax into ``amax_history[0]`` of
    its module (a running max), grad or no grad; only a grad-enabled ``fp8_autocast`` exit
    reduces that slot, rolls the history and zeroes it (the casts: ``atomicMaxFloat``,
    ``common/cast/fp8/quantize_fp8.cuh``; TE 2.9-2.20 ``quantization.py``
    ``FP8GlobalStateManager.autocast_exit`` -> ``reduce_and_update_fp8_tensors``, the same in
    2.20;
    ``common/recipe/delayed_scaling.cu``). A no-grad pass (the behaviour, reference and check
    passes over a whole phase) would so put its largest amax into the next training
    microbatch's reduction, and with our ``amax_compute_algo: max`` over 1024 steps into the
    scales of the ~1024 microbatches after it: scales from a phase's worst activation rather
    than the training's own. Here every forward slot of TE's global buffer (keys ``forward_*``)
    is put back after the pass: to its value before, or to 0 for a module first registered
    during it (a new module's history is zeros). A few KB copied a pass. ``manager``: TE's
    ``FP8GlobalStateManager`` unless given (the tests give a stand-in of its buffer, in either
    of TE's layouts: ``amax_buffer``)."""
    if not delayed:
        yield
        return
    if manager is None:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    def slots() -> list[torch.Tensor]:
        return [t for key, buf in amax_buffer(manager).items()
                if manager.split_key_in_buffer(key)[0] for t in buf]

    before = {id(t): t.clone() for t in slots()}
    try:
        yield
    finally:
        for t in slots():
            saved = before.get(id(t))
            t.copy_(saved) if saved is not None else t.zero_()


def amax_buffer(manager) -> dict[str, list[torch.Tensor]]:
    """TE's delayed-scaling amax buffer (``UPSTREAM_VERSIONED``): ``manager.global_amax_buffer``
    up to TE 2.14, ``manager.quantization_state.global_amax_buffer`` from 2.15 (read anew at
    every call: ``reset()`` replaces the state object)."""
    state = getattr(manager, "quantization_state", None)
    return (manager if state is None else state).global_amax_buffer


@contextmanager
def own_fp8_state_loadable():
    """Loading a checkpoint this stack wrote, with TE's FP8 delayed-scaling state in it. From TE
    2.17 ``set_extra_state`` classifies the pickled state (the scales and amax histories, in a
    uint8 tensor: ``get_extra_state``) and raises unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``
    is "1" (``_extra_state.should_load_extra_state_pickle``; 2.9-2.16 unpickle it as they
    find it): every FP8 resume of both shipped 70B FP8 configs would stop there on Python 3.12.
    A resume reads the run's own checkpoint (``learner/checkpoint.py``, its files verified first),
    so the variable is set for the load alone and put back; stateless recipes and runs without
    FP8 store an empty state, which TE never unpickles."""
    before = os.environ.get(UNSAFE_PICKLE_ENV)
    os.environ[UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(UNSAFE_PICKLE_ENV, None)
        else:
            os.environ[UNSAFE_PICKLE_ENV] = before

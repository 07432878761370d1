"""Every patch of, and reach into, megatron-core's internals, in one place.

Checked against megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12). Each part says why
it exists and where it applies; ``UPSTREAM_SYMBOLS`` lists the names the parts patch or read, which
``tests/test_compat.py`` and ``scripts/check_upstream.py`` find at both ends of the range.

1. **CPU stand-ins** (``megatron_on_cpu``), only when CUDA is absent (CI, laptops); a no-op
   context where ``torch.cuda.is_available()``. Inside it, and only there, each line below stands
   in for one megatron-core call:

   - ``torch.cuda.current_device()`` (rotary embeddings, TP layers, p2p shape tensors, DDP
     buffers, distributed optimizer) -> the CPU device.
   - ``torch.cuda.synchronize()`` (``p2p_communication.py``) -> no-op; gloo ops are synchronous.
   - ``torch.cuda.current_stream()`` (``start_grad_sync``, 0.19: it waits on CUDA-graph events)
     -> a stream whose waits do nothing.
   - ``torch.cuda.get_rng_state()`` / ``torch.cuda.manual_seed()`` and
     ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
     (``CudaRNGStatesTracker.add``, ``model_parallel_cuda_manual_seed``) -> the CPU generator.
   - ``device="cuda"`` / ``device=<int>`` in tensor factories (``schedules.py`` token counts,
     ``optimizer.py`` found-inf and scale buffers, ``clip_grads.py`` norms) -> ``device="cpu"``,
     and ``pin_memory=True`` (``rope_utils.get_pos_emb_on_this_cp_rank``, context parallel) ->
     not pinned, by a ``TorchFunctionMode`` active only inside the context.
   - ``Tensor.cuda()`` (optimizer state reload) -> the tensor itself.
   - ``tensor_parallel.random.CheckpointFunction.backward`` (activation recomputation,
     ``model.recompute`` full or selective) -> the same, with the stand-in below active: the
     autograd engine runs backward functions without the Python modes of the forward pass, and
     the recomputed forward makes tensors on ``device="cuda"`` (the causal mask).
   - ``Tensor.type()`` compared with ``'torch.cuda.FloatTensor'`` (``distrib_optimizer.py`` and
     others) -> the CUDA spelling of the CPU tensor's type.

2. **Without TE** (``without_transformer_engine``): 0.16.1's router GEMM tests
   ``moe_utils.te_general_gemm is not None``, defined only with TE: set to None. Its MLA tests
   ``HAVE_TE and isinstance(x, TELinear)``, which raises where ``TELinear`` is megatron's
   MagicMock: ``HAVE_TE`` False. 0.19's MLA binds the torch ``Linear`` its down projections may
   be only under ``HAVE_TE``: bound as with TE.

3. **Optimizer state with torch's Adam** (no apex or TE: the CPU, and GPUs without them):
   ``has_optimizer_state``, ``ensure_optimizer_state``, ``tolerate_missing_step``,
   ``unshare_steps``, for the fully reshardable distributed-optimizer checkpoints; each says
   which release needs it.

4. **Timeouts of every group** (``groups_time_out_after``): ``initialize_model_parallel``
   gives its ``distributed_timeout_minutes`` to every group but one: the expert data-parallel
   gloo group is made without a timeout (0.16.1 and 0.19.2, ``parallel_state.py``:
   ``create_group(ranks, backend="gloo", group_desc="EXPERT_DATA_PARALLEL_GROUP_GLOO")``), so
   it would keep torch's 30 minutes. While the groups are made, ``parallel_state.create_group``
   fills in the timeout where a call leaves it out.

5. **The distributed optimizer's state in model space, without a gather** (``optimizer_state_
   in_model_space``). megatron-core's layouts for it either gather each TP x PP shard's whole
   state on every DP rank ("fully_reshardable": ~55 GiB a rank in host memory at 70B on
   TP8 x PP4 x DP2), or tie the checkpoint to the TP x PP layout ("dp_reshardable"); the one
   that did neither, "fully_sharded_model_space", uses ``ShardedTensor.flattened_range``, which
   0.16.1 and 0.19.2 refuse. Inside the context its ``sharded_param_state_fs_model_space`` is
   ``_model_space_pieces``: each rank's flat slice of a parameter as at most three rectangles in
   model space (uneven shards for torch DCP), so each rank writes only what it holds and any
   layout reads any other's; a ``ShardedTensorFactory`` per state joins them back on load, and
   megatron's ``load_parameter_state_from_fs_model_space`` takes it from there.

6. **No compiled fusions on CPU** (``_import_megatron``, at this module's import): ``jit.py``
   sets ``jit_fuser = torch.compile`` (0.16.1, 0.19.2), importing dynamo and inductor (~4 s a
   start-up) for fusions a CPU run never calls: ``torch.compile`` is the identity meanwhile.

7. **Checkpoint writers that end with the run** (``checkpoint_writers_die_with_us``, before
   every save). megatron-core's file-system writer (``filesystem_async.py``) reports through the
   queue of a spawned manager kept in ``_results_queue`` (0.16.1, 0.19.2), 0.16.1 from forked
   writers (``FileSystemWriterAsync.write_preloaded_data``; 0.19.2 from threads). A SIGKILL of
   the run left the manager alive on every rank (``tests/test_user_data.py``): here it is
   started with ``procs.die_with_parent``, which a forked writer also calls first.

8. **YaRN through undeclared config attributes** (``yarn_config``): megatron-core's GPT model
   reads ``yarn_*`` config attributes by ``getattr`` (0.16.1 ``gpt_model.py`` 172-190), which no
   dataclass declares: set here. Its attention factor (``_yarn_get_concentration_factor_from_
   config``, which TE's fused RoPE refuses unless 1) is held at 1; ``model.py`` squares HF's
   into softmax_scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing.managers import SyncManager

import torch
from packaging.version import Version
from torch.overrides import TorchFunctionMode

from mugrpo_megatron.procs import die_with_parent


def _import_megatron() -> None:
    """Part 6: import megatron-core (once), without compiling its fusions where there is no GPU."""
    import sys

    if "megatron.core" in sys.modules or torch.cuda.is_available():
        import megatron.core  # noqa: F401
        return

    def identity(model=None, **_):
        return model if model is not None else (lambda fn: fn)

    real, torch.compile = torch.compile, identity
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = real


_import_megatron()
from megatron.core import package_info  # noqa: E402

MEGATRON_VERSION = Version(package_info.__version__.split("+")[0])
UPSTREAM_SYMBOLS: tuple[str, ...] = (
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    "megatron.core.tensor_parallel.random:CheckpointFunction.backward",
    "megatron.core.transformer.moe.moe_utils:router_gating_linear",
    "megatron.core.transformer.multi_latent_attention:HAVE_TE",
    "megatron.core.transformer.multi_latent_attention:TELinear",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
    "megatron.core.optimizer:ChainedOptimizer",
    "megatron.core.parallel_state:create_group",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fs_model_space",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_fs_model_space",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states",
    "megatron.core.dist_checkpointing.mapping:ShardedTensorFactory",
    "megatron.core.jit:jit_fuser",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync"
    ".write_preloaded_data",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding:"
    "_yarn_get_concentration_factor_from_config",
)
"""``module:attribute`` of every upstream name a part below patches or reads."""
_STREAM_WAITS_FROM = Version("0.19")


# ------------------------------------------------------------------ 1. CPU stand-ins

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
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name.count(".") == 1 else name
        if func is torch.Tensor.to and args[1:] and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """What megatron-core 0.19 does with ``torch.cuda.current_stream()`` on a CPU: nothing."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


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
    if MEGATRON_VERSION >= _STREAM_WAITS_FROM:
        stand_ins[("cuda", "current_stream")] = lambda *a, **k: _CpuStream()
    recompute = mrandom.CheckpointFunction
    backward = recompute.__dict__["backward"].__func__  # a staticmethod

    def backward_on_cpu(ctx, *args):
        with _CudaToCpu():
            return backward(ctx, *args)

    stand_ins[("checkpoint", "backward")] = staticmethod(backward_on_cpu)
    owners = {"cuda": torch.cuda, "random": mrandom, "checkpoint": recompute}
    for (owner, name), fn in stand_ins.items():
        _saved[f"{owner}.{name}"] = vars(owners[owner])[name]  # as defined: a staticmethod too
        setattr(owners[owner], name, fn)


def _unpatch() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    owners = {"cuda": torch.cuda, "random": mrandom, "checkpoint": mrandom.CheckpointFunction}
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


# ------------------------------------------------------------------ 2. without TE


def without_transformer_engine() -> None:
    """See part 2 of the module docstring (0.16.1 without Transformer Engine)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    if multi_latent_attention.Linear is None:  # 0.19 binds it only under HAVE_TE
        from megatron.core.post_training.modelopt.layers import Linear
        multi_latent_attention.Linear = Linear


# ------------------------------------------------------------------ 3. optimizer state


def inner_optimizers(optimizer) -> list:
    """megatron's optimizers inside ``optimizer`` (a ChainedOptimizer holds one for the dense and
    one for the expert parameters), each wrapping a torch optimizer as ``.optimizer``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def has_optimizer_state(optimizer) -> bool:
    """Whether every torch optimizer with parameters has state on this rank. torch's Adam creates
    its state at its first step; before it (a run whose first phase trained on nothing) megatron
    cannot describe a state it does not have."""
    return all(len(inner.optimizer.state) > 0 for inner in inner_optimizers(optimizer)
               if any(g["params"] for g in inner.optimizer.param_groups))


def ensure_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state tensors, which the loading state dict must describe
    (0.16.1 and 0.19.2 with torch's Adam, whose state and 'step' exist only after a first step):
    take one with zero gradients, lr and weight decay, which changes nothing (the loaded
    checkpoint then overwrites every value anyway)."""
    for inner in inner_optimizers(optimizer):
        opt = inner.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if all(len(opt.state[p]) > 0 for p in params):
            continue
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for g, (lr, wd) in zip(opt.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd


def tolerate_missing_step(optimizer) -> None:
    """With torch's Adam, megatron restores 'step' from the param groups and then, loading a
    fully reshardable state, copies every per-parameter state key from the checkpoint, which has
    no 'step' (KeyError: 0.16.1 copies every state key, 0.19.2 every tensor one, and torch's
    'step' is a tensor). Replace the distributed optimizer's private
    ``_set_main_param_and_optimizer_states`` with one that copies the keys the checkpoint has."""
    for inner in inner_optimizers(optimizer):
        if not hasattr(inner, "_set_main_param_and_optimizer_states") or \
                inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue

        def set_states(model_param, tensors, inner=inner):
            group_index, group_order = inner.model_param_group_index_map[model_param]
            main_param = inner.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **inner.optimizer.state[main_param]}
            for key, tensor in tensors.items():
                if torch.is_tensor(tensor):
                    dst[key].copy_(tensor)

        inner._set_main_param_and_optimizer_states = set_states


def unshare_steps(optimizer) -> None:
    """megatron restores torch Adam's 'step' as one tensor shared by every parameter's state
    (0.16.1, 0.19.2); torch increments each parameter's step in place, so a shared one would
    advance once per parameter and skew the bias correction. Give each parameter its own."""
    for inner in inner_optimizers(optimizer):
        for state in inner.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


# ------------------------------------------------------------------ 4. timeouts of every group


@contextlib.contextmanager
def groups_time_out_after(minutes: float) -> Iterator[None]:
    """See part 4 of the module docstring: inside, megatron's groups made without a timeout get
    ``minutes``."""
    import datetime

    from megatron.core import parallel_state

    real = parallel_state.create_group

    def create_group(*args, timeout=None, **kwargs):
        return real(*args, timeout=timeout or datetime.timedelta(minutes=minutes), **kwargs)

    parallel_state.create_group = create_group
    try:
        yield
    finally:
        parallel_state.create_group = real


# ------------------------------------------------------------------ 5. optimizer state in model space


def rectangles(start: int, end: int, shape: tuple[int, ...]
               ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[start, end)`` of a row-major flattening of ``shape`` as at most a few
    (offset, size) rectangles, in order; each is itself contiguous in that flattening."""
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, row), divmod(end, row)
    if r0 == r1:
        return [((r0, *o), (1, *z)) for o, z in rectangles(c0, c1, shape[1:])]
    out = []
    if c0:
        out += [((r0, *o), (1, *z)) for o, z in rectangles(c0, row, shape[1:])]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        out += [((r1, *o), (1, *z)) for o, z in rectangles(0, c1, shape[1:])]
    return out


def _parts(metadata, param: torch.Tensor) -> list:
    """The ShardedTensors a parameter's model state is saved as (a factory, such as the fused
    gate/up projection's, saves several), each with a meta tensor whose view of the parameter
    tells which of its elements it holds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ghost = torch.empty(param.shape, dtype=param.dtype, device="meta")
    if isinstance(metadata, ShardedTensor):
        return [dataclasses.replace(metadata, data=ghost)]
    built = metadata.build_fn(metadata.key, ghost, metadata.replica_id, None)
    return list(nested_values(built))


def _state_factory(key: str, shard: torch.Tensor, parts: list, start: int, end: int,
                   instance: int):
    """One optimizer state of one parameter (this rank's ``shard``: elements ``[start, end)`` of
    the flattened parameter) as rectangles of the model-space tensors its ``parts`` describe."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def layout():  # (name, part, offset in the part, size, offset in the shard)
        for i, part in enumerate(parts):
            view = part.data
            if not view.is_contiguous():
                raise NotImplementedError(f"{part.key}: a non-contiguous part of a parameter")
            lo = max(start, view.storage_offset())
            hi = min(end, view.storage_offset() + view.numel())
            for j, (off, size) in enumerate(rectangles(lo - view.storage_offset(),
                                                       hi - view.storage_offset(), view.shape)):
                flat = view.storage_offset() + sum(
                    o * math.prod(view.shape[d + 1:]) for d, o in enumerate(off))
                yield f"{i}.{j}", part, off, size, flat - start

    def build(factory_key, data, replica_id, flattened_range):
        out = {}
        for name, part, off, size, at in layout():
            # the axes megatron prepends (a layer's index in the stacked layers, an expert's)
            # are explicit here: torch DCP takes uneven chunks with every axis in their shape
            prepend = part.prepend_axis_num
            shape = (*[1] * prepend, *size)
            out[name] = ShardedTensor(
                key=f"{key}.{part.key}", data=data[at:at + math.prod(size)].view(shape),
                dtype=data.dtype, local_shape=shape, global_shape=part.global_shape,
                global_offset=(*part.global_offset[:prepend],
                               *(g + o for g, o in zip(part.global_offset[prepend:], off))),
                axis_fragmentations=None, replica_id=(*part.replica_id[:2], instance))
        return out

    def merge(loaded):
        out = torch.empty(end - start, dtype=shard.dtype, device=shard.device)
        for name, _, _, size, at in layout():
            out[at:at + math.prod(size)] = loaded[name].reshape(-1)
        return out

    return ShardedTensorFactory(key, shard, build, merge, replica_id=(0, 0, instance))


def _model_space_pieces(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """Replaces ``DistributedOptimizer.sharded_param_state_fs_model_space`` (part 5): the same
    structure, one entry per parameter in the order ``load_parameter_state_from_fs_model_space``
    reads, with a ``_state_factory`` per state instead of a flattened ShardedTensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_sd, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata_of = {sh.data: sh for sh in nested_values(model_sd)}
    state, index = {}, 0
    for gbuf_range_maps in self.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    where = ranges["param"]
                    tensors = self._get_main_param_and_optimizer_states(model_param)
                    tensors["fp32_param"] = tensors.pop("param")
                    parts = _parts(metadata_of[model_param], model_param)
                    state[index] = {
                        k: _state_factory(f"optimizer.state.{k}", t, parts, where.start,
                                          where.end, self.distributed_optimizer_instance_id)
                        for k, t in tensors.items() if k != "step"}
                    index += 1
    return state


@contextlib.contextmanager
def optimizer_state_in_model_space() -> Iterator[None]:
    """See part 5 of the module docstring: inside, megatron's 'fully_sharded_model_space' layout
    works again, without flattened ranges."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = DistributedOptimizer.sharded_param_state_fs_model_space
    DistributedOptimizer.sharded_param_state_fs_model_space = _model_space_pieces
    try:
        yield
    finally:
        DistributedOptimizer.sharded_param_state_fs_model_space = real


# ------------------------------------------------------------------ 7. checkpoint writers

_writer_manager = None
"""The manager process whose queue megatron's writers report to (started once, here)."""


def checkpoint_writers_die_with_us() -> None:
    """Part 7 (once a process, before its first save): megatron's results queue from a manager
    started with ``procs.die_with_parent``, and its writers in forked processes calling it
    first (not those in threads of this process: it would tie this process to its parent)."""
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if _writer_manager is not None:
        return
    saver = os.getpid()
    _writer_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    _writer_manager.start(initializer=die_with_parent, initargs=(saver,))
    fa._results_queue = _writer_manager.Queue()
    write = fa.FileSystemWriterAsync.write_preloaded_data

    @functools.wraps(write)
    def write_then_die_with_us(*args, **kwargs):
        if os.getpid() != saver:  # forked from the process that saves
            die_with_parent()
        return write(*args, **kwargs)

    fa.FileSystemWriterAsync.write_preloaded_data = staticmethod(write_then_die_with_us)


# ------------------------------------------------------------------ 8. YaRN


def yarn_config(config, rope: dict) -> None:
    """Part 8: megatron-core's YaRN fields on ``config`` from ``models.rope``'s dict, the
    concentration factor held at exactly 1 (``model.py`` applies HF's through softmax_scale)."""
    fields = {"yarn_rotary_scaling_factor": rope["factor"],
              "yarn_original_max_position_embeddings": rope["original_max_position_embeddings"],
              "yarn_beta_fast": rope["beta_fast"], "yarn_beta_slow": rope["beta_slow"],
              "yarn_mscale": 1.0, "yarn_mscale_all_dim": 1.0,
              "yarn_correction_range_round_to_int": rope["truncate"]}
    for name, value in fields.items():
        setattr(config, name, value)

"""Records every collective a rank issues, per process group, and checks that all members of each
group issued the same sequence: the rule whose breaking hangs a job (a rank waiting in a
collective its peers never enter, until the timeout), on NCCL as on gloo.

``CollectiveLog`` patches torch.distributed's collective functions (megatron-core calls them as
``torch.distributed.<name>(...)``, looked up at call time, so the patch sees its calls as well as
ours) and records, for the outermost call only (``all_gather_object`` calls ``all_gather``), the
operation and the shapes and dtypes of its tensors. Point-to-point sends and receives are recorded
per peer and checked in pairs. ``te_amax_emulation`` adds the per-microbatch collective that
Transformer Engine runs with FP8 delayed scaling, which no CPU run has: an all-reduce over
megatron's amax-reduction group after every grad-enabled forward of a transformer block (TE's
``fp8_autocast`` exit) and once in every backward through it (TE 2.0-2.20,
``FP8GlobalStateManager.reduce_and_update_fp8_tensors``; megatron-core 0.16/0.19
``fp8_utils.get_fp8_context`` gives it ``parallel_state.get_amax_reduction_group``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all_single",
               "all_to_all", "barrier", "all_gather_object", "broadcast_object_list",
               "gather_object", "_all_gather_base", "_reduce_scatter_base")
P2P = ("send", "recv", "isend", "irecv")


def _shape(x) -> object:
    if torch.is_tensor(x):
        return [list(x.shape), str(x.dtype).removeprefix("torch.")]
    if isinstance(x, (list, tuple)) and x and all(torch.is_tensor(t) for t in x):
        return [_shape(t) for t in x]
    return None


def group_key(group) -> str:
    """A group's name and ranks: the same on every member (torch names groups in the order they
    are made, which every member follows)."""
    if group is None:
        group = dist.group.WORLD
    return f"{group.group_name}:{','.join(map(str, dist.get_process_group_ranks(group)))}"


class CollectiveLog:
    """``with CollectiveLog() as log:`` records ``log.calls`` ({group key: [entry, ...]}) and
    ``log.p2p`` ({(peer, 'send'|'recv'): [shape, ...]}) of this rank; ``log.p2p_groups`` and
    ``log.batched_peers`` say which of those went in batches, and on which groups."""

    def __init__(self):
        self.calls: dict[str, list] = {}
        self.p2p: dict[str, list] = {}
        self.p2p_groups: set[str] = set()
        """The groups of batched point-to-point ops (``batch_isend_irecv``)..."""
        self.batched_peers: set[str] = set()
        """...and their peers."""
        self._depth = threading.local()
        self._saved: dict[str, object] = {}

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self._record(name, args, kwargs)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
        return recorded

    def _record(self, name: str, args, kwargs) -> None:
        if name in P2P:
            tensor = args[0] if args else kwargs.get("tensor")
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))  # global
            way = "send" if name in ("send", "isend") else "recv"
            self.p2p.setdefault(f"{peer}:{way}", []).append(_shape(tensor))
            return
        group = kwargs.get("group")
        if group is None and name not in ("barrier",):
            # the group argument's position: after the tensor(s) (and op, for reductions)
            for a in args[1:]:
                if isinstance(a, dist.ProcessGroup):
                    group = a
        shapes = [] if name.endswith("_object") or name == "broadcast_object_list" else \
            [s for s in (_shape(a) for a in (*args, *kwargs.values())) if s is not None]
        entry = [name, shapes]
        if name == "broadcast":  # its root (a global rank): who sends what the others receive
            entry.append(kwargs.get("src", args[1] if len(args) > 1 else None))
        self.calls.setdefault(group_key(group), []).append(entry)

    def _wrap_batch(self, fn):
        def recorded(p2p_ops):
            for op in p2p_ops:  # batch_isend_irecv: each op is a send or a receive
                way = "send" if op.op in (dist.isend, self._saved.get("isend")) else "recv"
                self.p2p.setdefault(f"{op.peer}:{way}", []).append(_shape(op.tensor))
                # NCCL runs a batch on its group's own communicator, not one a peer (torch
                # ProcessGroupNCCL::pointToPoint: "For batch P2P, we need to treat it like a
                # collective when selecting communicator")
                self.p2p_groups.add(group_key(op.group))
                self.batched_peers.add(str(op.peer))
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                return fn(p2p_ops)
            finally:
                self._depth.n -= 1
        return recorded

    def __enter__(self) -> CollectiveLog:
        wrapped = {}
        for name in (*COLLECTIVES, *P2P, "batch_isend_irecv"):
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            wrapped[fn] = self._wrap_batch(fn) if name == "batch_isend_irecv" else \
                self._wrap(name, fn)
            setattr(dist, name, wrapped[fn])
        # P2POp checks its op against distributed_c10d's own isend / irecv: the wrapped ones
        # there too, so that ops made with ``dist.isend`` inside the log are valid
        from torch.distributed import distributed_c10d

        for name in ("isend", "irecv"):
            setattr(distributed_c10d, name, getattr(dist, name))
        # modules that took a function at import (megatron-core's tensor-parallel mappings and
        # layers, its DDP buffers: ``dist_all_gather_func = torch.distributed.
        # all_gather_into_tensor``, 0.16/0.19) call that reference, not the attribute
        self._globals = []
        for mod in list(sys.modules.values()):
            if not getattr(mod, "__name__", "").startswith(("megatron", "mugrpo_megatron",
                                                            "transformer_engine")):
                continue
            for key, value in list(vars(mod).items()):
                if callable(value) and value in wrapped:
                    self._globals.append((mod, key, value))
                    setattr(mod, key, wrapped[value])
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import distributed_c10d

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
            if name in ("isend", "irecv"):
                setattr(distributed_c10d, name, fn)
        for mod, key, value in self._globals:
            setattr(mod, key, value)


def mismatches(logs: list[dict]) -> list[str]:
    """Every way the ranks' logs (``{"calls": ..., "p2p": ...}`` of each rank, in rank order)
    break the rule: a group whose members issued different sequences, a send without its
    receive. Empty when none does."""
    problems = []
    groups: dict[str, dict[int, list]] = {}
    for rank, log in enumerate(logs):
        for key, calls in log["calls"].items():
            groups.setdefault(key, {})[rank] = calls
    for key, by_rank in groups.items():
        members = [int(r) for r in key.split(":")[1].split(",")]
        seqs = {r: by_rank.get(r, []) for r in members}
        first = seqs[members[0]]
        for r in members[1:]:
            if seqs[r] != first:
                n = next((i for i, (a, b) in enumerate(zip(first, seqs[r])) if a != b),
                         min(len(first), len(seqs[r])))
                problems.append(f"group {key}: rank {members[0]} issued {len(first)} collectives, "
                                f"rank {r} {len(seqs[r])}; first difference at call {n}: "
                                f"{first[n] if n < len(first) else 'none'} against "
                                f"{seqs[r][n] if n < len(seqs[r]) else 'none'}")
    for rank, log in enumerate(logs):
        for key, sends in log["p2p"].items():
            peer, way = key.split(":")
            if way != "send":
                continue
            received = logs[int(peer)]["p2p"].get(f"{rank}:recv", [])
            if received != sends:
                problems.append(f"rank {rank} sent {len(sends)} tensors to rank {peer}, which "
                                f"received {len(received)} from it (or of other shapes)")
    return problems


@contextlib.contextmanager
def te_amax_emulation(learner, tp_only_amax_red: bool = False):
    """Transformer Engine's FP8 (delayed scaling) amax reduction, reproduced over gloo: an
    all-reduce of a small tensor over megatron's amax group after every grad-enabled forward of
    each chunk's transformer block, and once in each backward through it. Counts them."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_amax_reduction_group(with_context_parallel=True,
                                         tp_only_amax_red=tp_only_amax_red)
    counts = {"forward": 0, "backward": 0}

    def reduce(kind: str) -> None:
        counts[kind] += 1
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX, group=group)

    def after_forward(module, args, output):
        if not torch.is_grad_enabled():
            return
        reduce("forward")
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda grad: reduce("backward"))

    hooks = [chunk.decoder.register_forward_hook(after_forward) for chunk in learner.chunks()]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def bytes_moved(log: dict, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of rank ``rank``'s log (``{"calls": ..., "p2p": ...}``), by the
    ring algorithms NCCL runs: an all-gather of s bytes a rank over n ranks sends and receives
    (n - 1) s; a broadcast of S bytes: its root sends S, every other rank receives S; an
    all-reduce of S bytes: 2 (n - 1) / n S each way, a reduce-scatter half that; point-to-point:
    what was sent and received. Object collectives (pickles of a few small records here) are not
    counted."""
    sent = received = 0
    for key, calls in log["calls"].items():
        n = len(key.split(":")[1].split(","))
        for name, shapes, *root in calls:
            if not shapes or n == 1:
                continue
            sizes = [_nbytes(x) for x in shapes]
            if name in ("all_gather", "_all_gather_base", "all_gather_into_tensor"):
                out = (n - 1) * min(sizes)  # the input (the output is n times it)
                sent, received = sent + out, received + out
            elif name == "broadcast":
                if root[0] == rank:
                    sent += sizes[0]
                else:
                    received += sizes[0]
            elif name == "all_reduce":
                out = 2 * (n - 1) * sizes[0] // n
                sent, received = sent + out, received + out
            elif name in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter"):
                out = (n - 1) * max(sizes) // n
                sent, received = sent + out, received + out
    for key, shapes in log["p2p"].items():
        total = sum(_nbytes(x) for x in shapes)
        if key.endswith(":send"):
            sent += total
        else:
            received += total
    return sent, received


_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "uint8": 1, "bool": 1, "int8": 1}


def _nbytes(shape) -> int:
    """Bytes of a recorded ``[dims, dtype]``, or of a list of them (a tensor list)."""
    if len(shape) == 2 and isinstance(shape[1], str):
        return math.prod(shape[0]) * _ITEMSIZE.get(shape[1], 4)
    return sum(_nbytes(x) for x in shape)

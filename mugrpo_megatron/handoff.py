"""Who holds the accelerator: the learner or the rollout engines, and the weights between them.

A phase hands the device back and forth (``Handoff``): the learner's weights are streamed into
the engines (``sync_weights``), the learner steps aside to host memory while the engines
generate (``learner_offloaded``), and each transition is marked with the memory in use
(``mark_memory``), the ones the dry run budgets. Every method is collective.

With ``parallel.offload_learner`` the learner leaves the device whole before the engines wake
for a sync: weights, gradient buffers and optimizer state to pinned host memory, and the sync
streams each parameter from that host copy, one at a time, to the device and into the stream
(``Learner.host_tensor``; slime streams its sync from the host copy the same way): every sync
runs inside ``learner_offloaded``. The sync's device memory is then the engine's woken weights,
the stream and the engine's reload, with none of the learner's beside them; the learner stays on
the host through the generation after it and comes back when the engine sleeps.

The engines' sleep drops their weights on GPUs (vLLM's level 2, SGLang without a CPU backup:
``RolloutEngine.sleep_discards_weights``), so a sync is skipped only while the engines still hold
the learner's current update: never after such a sleep (``EngineFleet.has_weights``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from mugrpo_megatron import distributed
from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines.fleet import EngineFailed, EngineFleet
from mugrpo_megatron.layout.shapes import engine_slices_problem
from mugrpo_megatron.learner.export import iter_hf_tensors
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.metrics import MetricsLogger
from mugrpo_megatron.outputs import RunFailed
from mugrpo_megatron.phase import PhaseRecord


def sync_engine_tp(rollout: RolloutConfig, learner: Learner) -> int:
    """The engine TP size a sync streams each rank's engine slices for
    (``export.iter_hf_tensors(engine_tp=...)``), or 0 where every rank needs every tensor whole.
    vLLM placed spmd (every rank an engine TP rank, replica groups of consecutive ranks: engine
    TP rank = rank mod its TP) at a TP of at least 2 that is the learner's (each rank's own
    shards are its engine rank's: no gathers) or a multiple of it (``learner.engine_slices``:
    each rank's slices come from the ranks that hold them), with megatron's TP rank rank mod the
    learner's TP on every rank (its default order puts TP fastest). The last is checked on every
    rank and agreed on (one MIN all-reduce, at start): the stream is collective, so every rank
    takes the same path."""
    tp, engine_tp = learner.layout.tp_size, rollout.tensor_parallel
    if not (rollout.spmd and engine_tp > 1 and engine_tp % tp == 0):
        return 0
    if engine_tp > tp and engine_slices_problem(learner.spec, tp, engine_tp,
                                                dist.get_world_size() // learner.parallel.pipeline):
        return 0
    rank, _ = distributed.world()
    ok = torch.tensor(int(learner.layout.tp_rank == rank % tp), device=distributed.device())
    if dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return engine_tp if ok.item() else 0


class Handoff:
    def __init__(self, learner: Learner, offload: bool, bucket_bytes: int, log: MetricsLogger,
                 rank0: bool, ckpt_dir: Path, engine_tp: int = 0):
        self.learner = learner
        self.offload = offload
        """Whether the learner goes to host memory while the engines work
        (``parallel.offload_learner``)."""
        self.engine_tp = engine_tp
        """The engine TP a sync streams each rank's engine slices for (``sync_engine_tp``; 0:
        every tensor whole)."""
        self.bucket_bytes = bucket_bytes
        self.log, self.rank0, self.ckpt_dir = log, rank0, ckpt_dir
        self.engines: EngineFleet | None = None
        """Set once they started (``Trainer`` starts them with the learner offloaded)."""
        self.engine_has: int | None = None
        """The learner update whose weights the engines hold (None: none of the learner's)."""

    @contextmanager
    def learner_offloaded(self, rec: PhaseRecord | None = None):
        """The learner's weights and optimizer state in host memory while the engine works
        (``parallel.offload_learner``); back on the device, bit for bit, afterwards."""
        if not self.offload:
            yield
            return
        out = self.learner.offload()  # all of it, before the engine's weights wake for a sync
        try:
            yield
        except BaseException:
            if self.engines is not None:
                self.engines.sleep()  # failing anyway: at least not both on the device at once
            self.learner.onload()
            raise
        if self.engines.kv_cache_awake:
            # weights, gradients and Adam state beside the KV cache: what the dry run does not
            # budget for (an out-of-memory error hours into a run at 70B)
            raise RuntimeError("the learner would return to the device while the engine's KV "
                               "cache is awake: sleep the engine first")
        back = self.learner.onload()
        if rec is not None:
            rec.switch_seconds += out.seconds + back.seconds
            rec.offload_seconds, rec.onload_seconds = out.seconds, back.seconds
            rec.offload_gib = out.bytes_freed / 2**30

    def sync_weights(self) -> float:
        """Stream the learner's weights into the engines (collective); returns the seconds taken,
        0 when they already hold the learner's current weights (the same decision on every
        rank: both numbers are)."""
        if self.engine_has == self.learner.num_updates and self.engines.has_weights:
            return 0.0
        t0 = time.perf_counter()
        from_host = {}
        if self.offload:  # the learner is on the host (inside ``learner_offloaded``)
            if self.learner.on_device != "nothing":
                raise RuntimeError("sync_weights: with parallel.offload_learner the sync streams "
                                   "from the learner's host copy; call it inside "
                                   "learner_offloaded()")
            from_host = {"tensor_of": self.learner.host_tensor}
        self.engines.wake(weights_only=True)  # a sleeping engine has no weights to update
        stream = iter_hf_tensors(self.learner.chunks(), self.learner.spec,
                                 bucket_bytes=self.bucket_bytes, engine_tp=self.engine_tp,
                                 **from_host)
        try:
            self.engines.update_weights(stream)
        except EngineFailed as e:
            raise RunFailed(f"weight sync into the engine failed: {e}. Nothing of the learner "
                            f"was lost; resume from {self.ckpt_dir} by running again.") from None
        self.mark_memory("sync")
        self.engine_has = self.learner.num_updates
        return time.perf_counter() - t0

    def mark_memory(self, transition: str, phase: int | None = None) -> None:
        """A 'memory' record (rank 0) at each transition of a phase (the ones the dry run
        budgets: start, sync, generate, evaluate, reference, optimize, save): where the
        learner's state and the engine's memory are, and on a GPU the device memory in use and
        the allocator's peak since the previous mark, so a run's real peaks can be read against
        the estimate."""
        if not self.rank0:
            return
        values = {"transition": transition, "phase": phase,
                  "engine": self.engines.memory if self.engines is not None else "starting",
                  "learner_on_device": self.learner.on_device}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            values.update(device_used_gib=(total - free) / 2**30,
                          allocator_peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        self.log.log("memory", self.learner.num_updates, values)

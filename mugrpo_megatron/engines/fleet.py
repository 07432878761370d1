"""The engine replicas of a torchrun job, driven collectively from every rank.

Three placements (``rollout.placement``):

- **spmd** (vLLM): every rank hosts one tensor-parallel rank of an engine; ranks
  ``[r * tp, (r + 1) * tp)`` form replica ``r`` (whole nodes, where tp exceeds a node). A
  phase's generation does not come through here: each replica streams its share on its own
  (``phase.generation``), and ``agree`` ends it. A ``generate`` call (held-out evaluation)
  splits the prompts into one contiguous share per replica; the ranks of a replica all submit
  that share (vLLM's external launcher runs one scheduler per rank and relies on them seeing
  the same requests), and the replicas' answers are gathered on rank 0. Weights reach every
  replica from the learner ranks it shares a process with: the export stream already hands
  every rank every tensor.
- **node** (SGLang): one engine per node, started by the node's first rank (``LOCAL_RANK`` 0)
  with ``rollout.tensor_parallel`` of the node's GPUs in processes of its own; node ``n`` is
  replica ``n``, fed by the same streaming path, and takes every weight from the export stream
  of its own learner rank. One node: the same as rank0.
- **rank0**: one engine on global rank 0; the other ranks take part in the collectives only.

Every method here is collective: all ranks call it, in the same order. Failures are agreed on, so
that a replica that fails makes every rank raise the same error instead of leaving the others
waiting in a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mugrpo_megatron import distributed
from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines import make_engine
from mugrpo_megatron.engines.base import Generation, RolloutEngine, SamplingSpec, WeightSyncStats
from mugrpo_megatron.layout import Placement, launcher_ranks_per_node, placement, round_up


class EngineFailed(RuntimeError):
    """An engine failed on some rank; raised on every rank with its message."""


def free_memory() -> tuple[int, int, str]:
    """(free, total) bytes of the memory this rank's engine takes its budget from, and what it
    is: the GPU (``torch.cuda.mem_get_info``), or on CPU the host's available memory."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return free, total, f"GPU {torch.cuda.current_device()}"
    import psutil

    mem = psutil.virtual_memory()
    return mem.available, mem.total, "host memory"


def start_problem(cfg: RolloutConfig) -> str:
    """Why this rank's engine cannot start, known before any rank starts one ('' if none): less
    free GPU memory than ``rollout.gpu_memory_utilization`` of the GPU (vLLM refuses to start
    then: ``Free memory on device ... is less than desired GPU memory utilization``, 0.32-0.33,
    but only inside its start, after the collectives that make its groups), or on CPU less
    available memory than the KV cache it reserves (``rollout.cpu_kv_cache_gib``)."""
    free, total, what = free_memory()
    need = cfg.gpu_memory_utilization * total if torch.cuda.is_available() \
        else cfg.cpu_kv_cache_gib * 2**30
    if free >= need:
        return ""
    return (f"{what} on {distributed.host()} has {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB, and the engine needs {need / 2**30:.1f} GiB (rollout."
            + ("gpu_memory_utilization" if torch.cuda.is_available() else "cpu_kv_cache_gib")
            + "): another process may hold it (nvidia-smi lists them); free it, or lower that "
              "setting")


def inflight_prompts(r: RolloutConfig, streams: bool, running: int | None) -> int:
    """How many prompts of its share a replica keeps in its engine at once (0: all of them):
    ``rollout.max_inflight_prompts``, or else, for an engine that refills its batch as groups
    finish (``streams``), twice the groups it runs at once (``running`` sequences / G): its
    running batch stays full, with as many groups waiting to take a finished one's place, and
    what it holds does not grow with the share; for one that does not stream, windows of a
    shard's worth of groups."""
    if r.max_inflight_prompts:
        return r.max_inflight_prompts
    if not streams:
        return r.shard_prompts
    return round_up(2 * running, r.group_size) // r.group_size if running else 0


def share(n: int, part: int, parts: int) -> slice:
    """Part ``part`` of ``parts`` contiguous, in-order shares of ``n`` items, as even as possible
    (sizes differ by one at most): a replica's prompts of an evaluation or of a phase."""
    return slice(part * n // parts, (part + 1) * n // parts)


class EngineFleet:
    """The job's rollout engines; ``engine`` is this rank's (None where it holds none)."""

    def __init__(self, engine: RolloutEngine | None, cfg: RolloutConfig,
                 where: Placement | None = None):
        rank, world = distributed.world()
        self.engine = engine
        self.cfg = cfg
        self.placement = where or placement(cfg, world, launcher_ranks_per_node())
        """Where the job's engines run (``layout.placement``)."""
        self.num_replicas = self.placement.replicas
        self.replica = self.placement.replica(rank)
        self.is_leader = self.placement.leads(rank)
        """Whether this rank scores and persists its replica's answers."""
        self.has_weights = True
        """False while the engines hold no weights of the learner's: placeholders (started
        without loading them), or none after a sleep that discards them
        (``RolloutEngine.sleep_discards_weights``), until the next ``update_weights``."""
        self.sleep_discards_weights = distributed.from_rank0(
            engine.sleep_discards_weights if engine is not None else False)
        """Whether the engines' sleep drops their weights: rank 0's engine's (every placement
        puts one there), the same on every rank, since every rank must then sync."""
        self.memory = "awake"
        self._replica_group = None
        """This rank's replica's group, where a replica spans several ranks (spmd, TP > 1)."""
        self._replica_leader = 0
        """What the engines hold in accelerator memory: 'awake' (weights and KV cache), 'weights'
        (woken for a sync only) or 'asleep' (neither), as sleep() and wake() left them; kept on
        every device, so that the order of transitions is checked on CPU too."""

    @classmethod
    def start(cls, cfg: RolloutConfig, model_dir: str | Path, *, dtype: str, max_model_len: int,
              trust_remote_code: bool = False, load_weights: bool = True,
              timeout_minutes: float | None = None, tools=None) -> EngineFleet:
        """Start the engines of ``cfg.placement`` (collective). Without ``load_weights`` they
        start with placeholder weights and refuse to generate until ``update_weights`` ran
        (see ``make_engine``). First every rank that hosts one checks what it can before any
        starts (``start_problem``) and the ranks agree, so that one rank's problem stops them all
        at once; the engines' own start collectives time out after
        ``rollout.start_timeout_minutes``, their groups after ``timeout_minutes`` once started.
        ``tools`` (``trajectory.ToolSetup``, with ``rollout.tools``): each engine samples
        trajectories, its replica's leader running the tools."""
        rank, world = distributed.world()
        where = placement(cfg, world, launcher_ranks_per_node())
        with distributed.agreed(EngineFailed, "the rollout engine cannot start: {}".format):
            if where.hosts(rank) and (problem := start_problem(cfg)):
                raise RuntimeError(f"rank {rank}: {problem}")
        engine = None
        try:
            with distributed.agreed(EngineFailed, "the rollout engine did not start: {}".format):
                if where.hosts(rank):
                    # engines seeded once (not per request, as SGLang) draw apart on each node
                    engine_cfg = replace(cfg, seed=cfg.seed + where.replica(rank)) \
                        if where.kind == "node" else cfg
                    engine = make_engine(engine_cfg, model_dir, dtype=dtype,
                                         max_model_len=max_model_len,
                                         trust_remote_code=trust_remote_code,
                                         spmd=where.kind == "spmd", load_weights=load_weights,
                                         timeout_minutes=timeout_minutes,
                                         start_timeout_minutes=cfg.start_timeout_minutes)
        except EngineFailed:
            if engine is not None:  # started here, but another rank's did not
                engine.shutdown()
            raise
        fleet = cls(engine, cfg, where)
        fleet.has_weights = load_weights
        if where.kind == "spmd" and where.tensor_parallel > 1:
            # one small gloo group a replica, for what its leader tells its other ranks
            # (``replica_agree``); every rank makes every group, in order, as torch requires.
            # Its timeout is the run's (parallel.timeout_minutes), not torch's default of 30
            # minutes: a replica waiting on its leader through a long generation must not give
            # up before the world's collectives do.
            timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
            for r in range(where.replicas):
                ranks = list(range(r * where.tensor_parallel, (r + 1) * where.tensor_parallel))
                group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if r == fleet.replica:
                    fleet._replica_group, fleet._replica_leader = group, ranks[0]
        if tools is not None:  # every rank, so that one rank's failure stops them all
            with distributed.agreed(EngineFailed, "the tools did not start: {}".format):
                if engine is not None:
                    fleet.engine = tools.wrap(engine, cfg, fleet.is_leader,
                                              fleet._share if fleet._replica_group else None)
        return fleet

    def _share(self, value: object) -> object:
        """The replica leader's ``value`` on every rank of the replica (one broadcast in it)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._replica_leader, group=self._replica_group)
        return box[0]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                 rows: Sequence[dict] | None = None) -> list[list[Generation]] | None:
        """``sampling.n`` responses per prompt, in prompt order, on rank 0 (None on the others).
        ``rows``: each prompt's tool settings (engines that sample trajectories).

        Every rank passes the same prompts. Prompt ``i`` is sampled with seed
        ``sampling.seed + i * sampling.n`` whichever replica serves it (on engines that seed per
        request), so the samples do not depend on the number of replicas."""
        self.check_has_weights()
        if self.placement.kind == "spmd" and self.cfg.tensor_parallel > 1 and sampling.seed is None:
            # each rank of a replica samples on its own; unseeded, they could draw different
            # tokens and their schedulers would part ways
            raise ValueError("a seed is needed with engine replicas at TP > 1 (placement spmd)")
        result: list[list[Generation]] | None = None
        with distributed.agreed(EngineFailed):
            if self.engine is not None:
                mine = share(len(prompts), self.replica, self.num_replicas)
                extra = {"rows": lambda k: rows[mine.start + k]} \
                    if rows is not None and self.engine.takes_rows else {}
                result = self.engine.generate(prompts[mine], sampling.from_position(mine.start),
                                              **extra) if mine.stop > mine.start else []
        rank, world = distributed.world()
        if self.num_replicas == 1:
            return result if rank == 0 else None
        parts: list | None = [None] * world if rank == 0 else None
        dist.gather_object(result if self.is_leader else None, parts, dst=0)
        if rank != 0:
            return None
        return [group for part in parts if part is not None for group in part]

    @property
    def queued(self) -> int:
        """Prompts this rank's replica keeps in its engine while it streams (``inflight_prompts``;
        0 on a rank without an engine)."""
        if self.engine is None:
            return 0
        return inflight_prompts(self.cfg, self.engine.streams, self.engine.max_running_sequences)

    def stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
               positions: Sequence[int], rows: Callable[[int], dict] | None = None
               ) -> Iterator[tuple[int, list[Generation]]]:
        """This rank's replica streams ``prompts`` (its share of a phase, at phase ``positions``)
        with ``queued`` of them in its engine at once, yielding ``(i, responses)`` as each group
        finishes; nothing on a rank without an engine. Not collective: the caller agrees on how
        it ended (``phase.generation.generate_phase``)."""
        if self.engine is None:
            return iter(())
        # each prompt's tool settings to the tools (``rows(i)``, i in ``prompts``), as generate
        extra = {"rows": rows} if rows is not None and self.engine.takes_rows else {}
        return self.engine.generate_stream(prompts, sampling, positions=positions,
                                           max_in_flight=self.queued, **extra)

    def replica_agree(self, value: int) -> int:
        """The replica leader's ``value`` on every rank of its replica (not collective over the
        job: one broadcast inside a replica that spans several ranks, nothing otherwise); 0 on a
        rank without an engine, which streams nothing."""
        if self.engine is None:
            return 0
        return value if self._replica_group is None else int(self._share(value))

    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]]
                       ) -> WeightSyncStats | None:
        """Load ``weights`` (the export stream, which is itself collective) into this rank's
        engine; this rank's stats (None without an engine). ``EngineFailed`` on every rank when
        any engine refused them."""
        stats = None
        with distributed.agreed(EngineFailed) as failure:
            if self.engine is not None:
                with failure.kept():
                    stats = self.engine.update_weights(weights)
            for _ in weights:  # ranks without an engine, and one that refused part way, finish it
                pass
        self.has_weights = True
        return stats

    def check_has_weights(self) -> None:
        """Refuse to sample from weights the engines do not hold: placeholders (started without
        loading them), or none since a sleep that dropped them."""
        if not self.has_weights:
            raise RuntimeError("the engines hold none of the learner's weights (they started "
                               "without them, or a sleep dropped them): sync the learner's "
                               "weights first")

    def sleep(self) -> float:
        """Release the engines' memory; the seconds it took."""
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.sleep()
        if self.sleep_discards_weights and self.memory != "asleep":
            self.has_weights = False  # nothing to sample from until the next sync
        self.memory = "asleep"
        return time.perf_counter() - t0

    def wake(self, weights_only: bool = False) -> float:
        """Take the engines' memory back (the weights' alone with ``weights_only``); the
        seconds it took."""
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.wake(weights_only=weights_only)
        if not (weights_only and self.memory == "awake"):
            self.memory = "weights" if weights_only else "awake"
        return time.perf_counter() - t0

    @property
    def kv_cache_awake(self) -> bool:
        return self.memory == "awake"

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def describe(self) -> str:
        """Where the replicas run and, where this rank hosts one, how a sync's weights reach it
        (an FP8 engine's scales)."""
        held = self.engine.weight_format if self.engine is not None else ""
        return self.placement.describe() + (f"; {held}" if held else "")

"""Generating one phase: every engine replica streams its share of the phase's prompts, and its
leader scores and persists whole groups as shards while the engine goes on generating. No
collective runs between the phase's start and its end.

Who does what (collective at the two ends only):

1. Rank 0 lists the groups already on disk (a resumed phase) and every rank receives that list as
   one byte per group (``phase.prompts_per_phase`` bytes: 10^5 at the paper's scale).
2. Each replica takes a static, contiguous, even share of the groups still to generate. Why
   static and not a shared queue: the phase's prompts are in seeded random order, so equal
   counts are equal expected work, and at 10^4-10^5 groups per replica the shares finish within a
   few long responses of each other; a queue would need a coordinator across nodes for a gain of
   that size. Inside its share a replica streams (``RolloutEngine.generate_stream``): its batch is
   refilled as groups finish, so no response waits for another.
3. The replica's leader decodes each finished group and queues it on its own reward pool
   (``RewardScorer.submit``): scoring never blocks an engine step unless ``_MAX_PENDING_SHARDS``
   shards are waiting for scores (back-pressure, counted as ``score_wait_seconds``). Scored
   groups are written as a shard of ``rollout.shard_prompts`` groups (``phase.store``).
4. At the end, the replicas agree on errors (``distributed.agreed``) and sum their counts (a few
   integers), and rank 0 indexes the phase: advantages and uniform groups, vectorised, once
   (``phase.store.finalize``). ``generate_phase`` is this protocol; the trainer calls it.

Memory on a leader: the groups in the engine (as vLLM's Python objects), plus at most
``_MAX_PENDING_SHARDS + 1`` shards of groups as numpy arrays and decoded text (~12 bytes a token:
~25 MB a shard of 256 prompts x 8 responses x 1000 tokens); nothing grows with the phase.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mugrpo_megatron import distributed
from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.data.prompt_store import PromptSet
from mugrpo_megatron.distributed import on_rank0
from mugrpo_megatron.engines.fleet import EngineFleet, share
from mugrpo_megatron.phase.record import PhaseRecord
from mugrpo_megatron.phase.refill import (
    PENDING,
    Refill,
    RefillPlan,
    extension,
    position_states,
    targets,
)
from mugrpo_megatron.phase.schedule import Phase
from mugrpo_megatron.phase.store import Advantages, ScoredGroup, finalize, write_shard
from mugrpo_megatron.rewards import PendingScores, RewardScorer, RowInfo
from mugrpo_megatron.rewards.scorer import MAX_FAILURE_EXAMPLES, describe_failures
from mugrpo_megatron.trajectory import model_text, tool_rows
from mugrpo_megatron.types import Generation, Prompt, SamplingSpec

_MAX_PENDING_SHARDS = 4
"""Shards a leader lets wait for their scores before it waits too (bounds its memory)."""


_GENERATIONS = itertools.count()
"""Calls of ``generate_phase`` in this process (the same on every rank): each its own keys in
the store (``distributed.Arrival``)."""


def phase_seed(seed: int, phase: int) -> int:
    """Base seed of a phase: sample j of the prompt at position k samples with
    ``phase_seed + k * G + j``, whichever replica serves it and whenever."""
    return (seed * 1_000_003 + phase * 10_007) % 2**31 * 2**31


@dataclass
class ReplicaCounts:
    """What one replica did in a phase (summed over replicas at the end)."""

    groups: int = 0
    responses: int = 0
    tokens: int = 0
    reward_timeouts: int = 0
    reward_errors: int = 0
    shards: int = 0
    informative: int = 0
    """Groups whose rewards differ (counted by the leader as their scores came in)."""
    refill_groups: int = 0
    """Groups generated past the phase's planned prompts (``uniform_groups: refill``)."""
    refill_rounds: int = 0
    """Refill rounds this replica made (the most over the replicas, not summed)."""
    score_wait_seconds: float = 0.0
    """Rank 0's leader, blocked on its reward pool (not summed)."""
    failed_by_source: dict[str, int] = field(default_factory=dict)
    """Responses whose reward failed (errors and timeouts), by source."""
    messages: list[str] = field(default_factory=list)
    """The first reward failures with their source, row and error (the replicas' first few,
    gathered)."""
    queued: int = 0
    """Prompts the replica kept in its engine at once (not summed)."""

    def totals(self) -> list[int]:
        return [self.groups, self.responses, self.tokens, self.reward_timeouts,
                self.reward_errors, self.shards, self.informative, self.refill_groups]

    @property
    def reward_failures(self) -> int:
        return self.reward_timeouts + self.reward_errors

    def describe_failures(self) -> str:
        """The reward failures in one line (``rewards.describe_failures``)."""
        return describe_failures(self.reward_failures, self.responses, self.failed_by_source,
                                 self.messages)

    def record(self, rec: PhaseRecord, seconds: float) -> None:
        """Put the numbers of a generation that took ``seconds`` into the phase's record."""
        rec.generate_seconds = seconds
        rec.score_seconds = self.score_wait_seconds
        rec.reward_timeouts, rec.reward_errors = self.reward_timeouts, self.reward_errors
        if self.reward_failures:
            rec.reward_failures_by_source = dict(self.failed_by_source)
            rec.reward_failure_examples = list(self.messages)
        rec.generated_groups, rec.rollout_shards = self.groups, self.shards
        rec.refill_groups, rec.refill_rounds = self.refill_groups, self.refill_rounds
        rec.inflight_prompts = self.queued
        rec.generate_tokens_per_s = self.tokens / seconds if seconds else None


class GenerationFailed(RuntimeError):
    """A replica failed while generating its share of a phase; raised on every rank, with every
    shard written so far kept."""


def generate_phase(fleet: EngineFleet, directory: Path, phase: Phase, r: RolloutConfig,
                   prompts: PromptSet, scorer: RewardScorer | None, tokenizer, progress,
                   advantages: Advantages, refill: Refill | None = None,
                   index_of: Callable[[int], int] | None = None) -> ReplicaCounts:
    """The protocol of this module's docstring, on every rank, collective at its two ends: this
    rank's replica streams its share of the groups not yet on disk (``fleet.stream``: the
    prompts read from ``prompts`` as they enter the engine), its leader scores and writes shards
    as groups finish, the ranks agree on how it went and sum their counts, and rank 0 indexes
    the phase. With ``refill`` each replica then generates from further prompts (``refill``'s
    module docstring); ``index_of(position)``: the prompt set's index of the phase's prompt at
    ``position`` (past the planned ones too). Returns the counts summed over the replicas
    (refill rounds: the most); ``GenerationFailed`` on every rank when any replica failed."""
    planned = len(phase.prompt_indices)
    index_of = index_of or phase.prompt_indices.__getitem__
    state = position_states(directory, refill.cap(planned) if refill else planned,
                            r.group_size, advantages if refill else None)
    pending = np.flatnonzero(state[:planned] == PENDING)
    mine = pending[share(len(pending), fleet.replica, fleet.num_replicas)]
    counts = ReplicaCounts(queued=fleet.queued)
    fleet.check_has_weights()
    bar = progress.bar(f"phase {phase.index} generate (replica {fleet.replica} of "
                       f"{fleet.num_replicas})", total=len(mine))
    sampling = sampling_for_phase(r, phase.index)
    # replicas finish (refill rounds, long tails) at different times: the done ones wait on the
    # host, not in a collective, failing only when the rest make no progress for the timeout
    arrival = distributed.Arrival(f"generate/{phase.index}/{next(_GENERATIONS)}")
    with distributed.agreed(GenerationFailed, arrival=arrival) as failure:
        writer = ShardWriter(directory, scorer, tokenizer, prompts, index_of, r.shard_prompts,
                             counts, advantages) if fleet.is_leader else None

        def stream(positions: list[int]) -> None:
            rows = (lambda i: tool_rows(prompts[index_of(positions[i])])) if r.tools else None
            for i, gens in fleet.stream(prompts.ids_view([index_of(p) for p in positions]),
                                        sampling, positions=positions, rows=rows):
                if writer is not None and not failure.error:
                    # a failed write does not stop the engine: the other ranks of this
                    # replica's tensor-parallel group step with it until the share is done
                    with failure.kept("scoring and writing rollouts: "):
                        writer.add(positions[i], gens)
                bar.update(1)
                arrival.beat()

        stream(mine.tolist())
        if refill is not None:
            more = extension(planned, state, fleet.replica, fleet.num_replicas)
            plan = RefillPlan(targets(planned, state, fleet.num_replicas)[fleet.replica],
                              refill.max_rounds)
            while True:
                size = 0
                if writer is not None and not failure.error:
                    with failure.kept("scoring and writing rollouts: "):
                        writer.drain()  # every group of the share scored: the deficit is known
                        size = plan.next_round(counts.informative, counts.groups, len(more))
                size = fleet.replica_agree(size)  # the replica's ranks queue the same prompts
                if not size:
                    break
                batch, more = more[:size], more[size:]
                counts.refill_groups += len(batch)
                stream(batch)
            counts.refill_rounds = plan.rounds
        if writer is not None and not failure.error:
            writer.close()
    bar.close()
    total = sum_counts(counts, prompts.sources)
    on_rank0(finalize, directory, planned, r.group_size, advantages)
    return total


class ShardWriter:
    """On a replica's leader: decode finished groups, keep them compact, queue them for scoring,
    and write each shard once its scores are in."""

    def __init__(self, directory: Path, scorer: RewardScorer, tokenizer, prompts: Sequence[Prompt],
                 index_of: Callable[[int], int], shard_prompts: int, counts: ReplicaCounts,
                 advantages: Advantages | None = None):
        self.directory = directory
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.index_of = index_of
        """The prompt set's index of the phase's prompt at a position."""
        self.advantages = advantages or Advantages()
        """How rewards are shaped, for counting the informative groups."""
        self.shard_prompts = shard_prompts
        self.counts = counts
        self._open: list[tuple[ScoredGroup, list[str], Prompt]] = []
        self._scoring: deque[tuple[list[ScoredGroup], PendingScores]] = deque()

    def add(self, position: int, gens: list[Generation]) -> None:
        """Take one finished group: its texts for the reward, its tokens as numpy arrays (the
        engine's tuples of Python numbers, ~70 bytes a token, go at once)."""
        prompt = self.prompts[self.index_of(position)]
        texts = [model_text(self.tokenizer, g) for g in gens]  # the model's, not its tools'
        self._open.append((ScoredGroup.of(position, prompt.index, prompt.token_ids, gens, [],
                                          prompt.source), texts, prompt))
        self.counts.responses += len(gens)
        self.counts.tokens += sum(len(g.token_ids) for g in gens)
        if len(self._open) >= self.shard_prompts:
            self._submit()
        self._write_scored(wait=len(self._scoring) > _MAX_PENDING_SHARDS)

    def drain(self) -> None:
        """Score and write every group taken so far (waits)."""
        if self._open:
            self._submit()
        while self._scoring:
            self._write_scored(wait=True)

    def close(self) -> None:
        """Score and write what is left (waits)."""
        self.drain()

    def _submit(self) -> None:
        groups, self._open = self._open, []
        texts = [t for _, ts, _ in groups for t in ts]
        answers = [p.answer for _, ts, p in groups for _ in ts]
        rows = [row for _, ts, p in groups
                for row in [RowInfo(p.source, p.text, p.metadata, p.index)] * len(ts)]
        self._scoring.append(([g for g, _, _ in groups],
                              self.scorer.submit(texts, answers, rows)))

    def _write_scored(self, wait: bool) -> None:
        while self._scoring and (wait or self._scoring[0][1].done()):
            groups, pending = self._scoring.popleft()
            t0 = time.perf_counter()
            outcome = pending.result()
            self.counts.score_wait_seconds += time.perf_counter() - t0
            self.counts.reward_timeouts += outcome.num_timeouts
            self.counts.reward_errors += outcome.num_errors
            for source, n in outcome.failed_by_source.items():
                self.counts.failed_by_source[source] = self.counts.failed_by_source.get(source, 0) + n
            self.counts.messages += outcome.errors[:max(0, MAX_FAILURE_EXAMPLES
                                                          - len(self.counts.messages))]
            rewards = iter(outcome.rewards)
            scored = [replace(g, rewards=[next(rewards) for _ in g.responses]) for g in groups]
            write_shard(self.directory, scored)
            self.counts.informative += int(self.advantages.informative(
                np.concatenate([g.rewards for g in scored]),
                np.concatenate([[len(x) for x in g.responses] for g in scored]),
                len(scored[0].responses)).sum())
            self.counts.groups += len(groups)
            self.counts.shards += 1
            wait = False  # one shard per call when back-pressure asked for it


def sum_counts(counts: ReplicaCounts, sources: Sequence[str]) -> ReplicaCounts:
    """Every replica's counts, summed on every rank (two small all-reduces: the sums, with the
    reward failures of each of the prompt set's ``sources``, and the most refill rounds). Only
    leaders count. Where any reward failed (every rank knows it from the sums), the replicas'
    first failures are gathered too (an all-gather of a few short strings a rank), so that the
    phase names them whichever replica saw them."""
    by_source = [counts.failed_by_source.get(s, 0) for s in sources]
    t = torch.tensor(counts.totals() + by_source, dtype=torch.int64, device=distributed.device())
    rounds = torch.tensor([counts.refill_rounds], dtype=torch.int64, device=distributed.device())
    messages = counts.messages
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    sums = t.cpu().tolist()
    totals = sums[:len(sums) - len(sources)]
    out = ReplicaCounts(*totals, refill_rounds=int(rounds.item()),
                        score_wait_seconds=counts.score_wait_seconds, queued=counts.queued,
                        failed_by_source={s: n for s, n in zip(sources, sums[len(totals):]) if n})
    if out.reward_failures and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, messages)
        messages = [m for ms in gathered for m in ms]
    out.messages = messages[:MAX_FAILURE_EXAMPLES]
    return out


def sampling_for_phase(r, phase_index: int) -> SamplingSpec:
    return SamplingSpec(n=r.group_size, max_new_tokens=r.max_new_tokens,
                        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        seed=phase_seed(r.seed, phase_index))

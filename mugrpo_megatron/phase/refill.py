"""``algo.uniform_groups: refill`` (DAPO's dynamic sampling): a phase generates from further
prompts until it holds as many informative groups (rewards not all equal) as prompts it was
planned for, so that its updates draw from informative groups only and make the pass they were
planned to.

Each engine replica refills its own share, with no barrier between replicas:

- the phase's positions past its planned N prompts are the run's next prompts (positions N,
  N + 1, ... of the phase, the run's stream after the phase's own); replica r of R owns the
  positions N + r, N + r + R, ..., below N x (1 + ``algo.max_refill_rounds``) (``Refill.cap``);
- it aims at its share of the informative groups still needed (N less those on disk when the
  generation started, split over the replicas as their prompts are: ``targets``);
- once its share of the planned prompts is scored, its leader sizes a round by the deficit and
  the informative rate it saw (``RefillPlan``), tells the replica's other ranks (one broadcast
  inside the replica: its tensor-parallel ranks must queue the same prompts), and streams the
  round's prompts like any others; then again, up to ``max_refill_rounds`` rounds.

A replica that falls short after its rounds stops there and the phase trains on what it has
(as 'drop' would); a replica that does better does not lend its surplus: each shard of work
finishes on its own. Groups persist as they finish, so a kill in a refill round loses at most
the groups in flight; a resume (with any number of replicas) reads which positions are on disk
and which of them are informative (``position_states``: one byte a position, N x (1 +
rounds) of them, from rank 0 to every rank) and regenerates nothing that was persisted. Which
positions a phase ends with depends on the replicas' count; the next phase starts after the
last position used (its prompts that no replica reached are skipped, at most R x rounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mugrpo_megatron import distributed
from mugrpo_megatron.phase.store import Advantages, informative_groups, persisted_groups

PENDING, UNIFORM, INFORMATIVE = 0, 1, 2
"""A position's state (``position_states``)."""
MIN_RATE = 1 / 16
"""The lowest informative rate a round is sized by (a replica that saw none yet still asks for
a bounded round: at most 16 prompts for each informative group it lacks)."""


@dataclass(frozen=True)
class Refill:
    """A phase's refill bounds (``algo.max_refill_rounds``)."""

    max_rounds: int

    def cap(self, planned: int) -> int:
        """Positions a phase may use: its planned prompts and ``max_rounds`` times as many."""
        return planned * (1 + self.max_rounds)


def position_states(directory: Path, positions: int, group_size: int,
                    advantages: Advantages | None) -> np.ndarray:
    """[positions] uint8, the same on every rank (collective: rank 0 reads the shards, one
    broadcast): PENDING for a group not on disk, else UNIFORM or INFORMATIVE (with
    ``advantages``; without, every persisted group reads INFORMATIVE)."""
    state = torch.zeros(positions, dtype=torch.uint8)
    if dist.get_rank() == 0:
        for tmp in directory.glob(".shard_*.arrow.tmp"):  # a shard a kill caught half-written
            tmp.unlink()
        done = persisted_groups(directory, positions)
        values = np.where(done, INFORMATIVE, PENDING).astype(np.uint8)
        if advantages is not None and done.any():
            values[done & ~informative_groups(directory, positions, group_size,
                                              advantages)] = UNIFORM
        state = torch.from_numpy(values)
    if dist.get_world_size() > 1:
        state = state.to(distributed.device())
        dist.broadcast(state, src=0)
    return state.cpu().numpy()


def targets(planned: int, state: np.ndarray, replicas: int) -> list[int]:
    """Each replica's share of the informative groups the phase still lacks."""
    lacking = max(0, planned - int((state == INFORMATIVE).sum()))
    return [lacking * (r + 1) // replicas - lacking * r // replicas for r in range(replicas)]


def extension(planned: int, state: np.ndarray, replica: int, replicas: int) -> list[int]:
    """Replica ``replica``'s positions past the planned ones, in order, those on disk left out."""
    return [p for p in range(planned + replica, len(state), replicas) if state[p] == PENDING]


class RefillPlan:
    """One replica leader's rounds: each sized by the informative groups it lacks at the rate it
    has seen, at most ``max_rounds`` of them and never past its positions."""

    def __init__(self, target: int, max_rounds: int):
        self.target, self.max_rounds = target, max_rounds
        self.rounds = 0

    def next_round(self, informative: int, scored: int, left: int) -> int:
        """Prompts of the next round (0: done) after ``scored`` groups of which ``informative``
        were, with ``left`` positions still to take."""
        lacking = self.target - informative
        if lacking <= 0 or self.rounds >= self.max_rounds or left <= 0:
            return 0
        rate = max((informative + 1) / (scored + 2), MIN_RATE)  # Laplace: never 0 or 1
        self.rounds += 1
        return min(left, math.ceil(lacking / rate))

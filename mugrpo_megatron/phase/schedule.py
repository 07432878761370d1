"""The phase scheduler: which prompts each phase generates for, and which samples each update uses.

Pure and deterministic (seeded): no process groups, no model. GRPO (mu = 4) and Mu-GRPO
(mu = 1024) are two settings of the same scheduler: ``total_updates / mu`` phases of ``mu`` updates.

Within a phase the learner makes ``mu`` passes of ``samples_per_update`` samples over the phase's
data: the samples are shuffled anew each epoch and cut into minibatches; as many epochs as ``mu``
requires are taken (a partial last epoch is normal). A minibatch never straddles two epochs, so each
epoch sees each sample at most once; the tail of an epoch shorter than a minibatch is left for the
next shuffle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mugrpo_megatron.config import AlgoConfig, Config


@dataclass(frozen=True)
class Phase:
    """One generate-then-optimize phase."""

    index: int
    """0-based phase number."""
    first_update: int
    """Global index of the phase's first optimizer update."""
    num_updates: int
    """mu: optimizer updates in this phase."""
    prompt_indices: tuple[int, ...]
    """Dataset rows this phase generates responses for."""


@dataclass(frozen=True)
class Minibatch:
    """The samples of one optimizer update."""

    update: int
    """Global update index (0-based)."""
    step_in_phase: int
    """Update index within the phase; the staleness of the behaviour policy in updates."""
    epoch: int
    """Pass over the phase's data this minibatch belongs to."""
    sample_indices: tuple[int, ...]
    """Indices into the phase's (filtered) samples."""


class PhaseScheduler:
    """Phases and minibatches for ``algo.total_updates`` updates at ``algo.updates_per_phase`` (mu).

    Built from the config, which has checked every schedule setting (``AlgoConfig``, ``Config``);
    only the data set's size is new here."""

    def __init__(self, algo: AlgoConfig, group_size: int, num_prompts: int):
        if num_prompts < 1:
            raise ValueError("the prompt dataset is empty")
        self.num_phases = algo.num_phases
        self.updates_per_phase = algo.updates_per_phase
        self.prompts_per_phase = algo.prompts_per_phase
        self.group_size = group_size
        self.samples_per_update = algo.samples_per_update
        self.num_prompts = num_prompts
        self.seed = algo.seed

    def phase(self, index: int) -> Phase:
        """Phase ``index``. Prompts are read in a seeded order, reshuffled at each pass over the
        dataset, so consecutive phases see fresh prompts until the dataset is used up."""
        if not 0 <= index < self.num_phases:
            raise IndexError(f"phase {index} out of range [0, {self.num_phases})")
        start = index * self.prompts_per_phase
        prompts: list[int] = []
        perms: dict[int, torch.Tensor] = {}
        for pos in range(start, start + self.prompts_per_phase):
            data_epoch, offset = divmod(pos, self.num_prompts)
            if data_epoch not in perms:
                perms[data_epoch] = self._permutation(self.num_prompts, 0, data_epoch)
            prompts.append(int(perms[data_epoch][offset]))
        return Phase(index=index, first_update=index * self.updates_per_phase,
                     num_updates=self.updates_per_phase, prompt_indices=tuple(prompts))

    def phases(self) -> Iterator[Phase]:
        for i in range(self.num_phases):
            yield self.phase(i)

    def update_size(self, num_samples: int, once: bool, quantum: int = 1) -> int:
        """Samples an update takes: ``samples_per_update`` (all of them when the phase has fewer),
        or with ``once`` the phase's samples / mu, so that mu updates are one pass; a multiple of
        ``quantum`` (the learner's DP x micro-batch) either way, and at least one quantum."""
        size = min(self.samples_per_update, num_samples)
        if once:
            size = min(size, num_samples // self.updates_per_phase)
        return max(quantum, size // quantum * quantum)

    def minibatches(self, phase: Phase, num_samples: int, size: int | None = None
                    ) -> Iterator[Minibatch]:
        """The ``phase.num_updates`` minibatches over ``num_samples`` samples (after any
        filtering), of ``size`` samples (default: ``samples_per_update``, or all when filtering
        left fewer)."""
        if num_samples < 1:
            raise ValueError(f"phase {phase.index} has no samples to train on")
        size = min(size or self.samples_per_update, num_samples)
        per_epoch = num_samples // size
        for step in range(phase.num_updates):
            epoch, slot = divmod(step, per_epoch)
            if slot == 0:
                perm = self._permutation(num_samples, 1 + phase.index, epoch)
            chosen = perm[slot * size:(slot + 1) * size]
            yield Minibatch(update=phase.first_update + step, step_in_phase=step, epoch=epoch,
                            sample_indices=tuple(int(i) for i in chosen))

    def passes(self, num_samples: int, size: int | None = None) -> float:
        """Passes over the phase's ``num_samples`` samples that mu updates of ``size`` make."""
        return passes(self.updates_per_phase, min(size or self.samples_per_update, num_samples),
                      num_samples)

    def _permutation(self, n: int, stream: int, epoch: int) -> torch.Tensor:
        mixed = (self.seed * 0x9E3779B1 + stream * 0x85EBCA6B + epoch * 0xC2B2AE35) % (1 << 63)
        g = torch.Generator().manual_seed(mixed)
        return torch.randperm(n, generator=g)


def passes(updates: int, samples_per_update: int, num_samples: int) -> float:
    """Passes over ``num_samples`` samples that ``updates`` updates of ``samples_per_update``
    make: the one formula of the phase log, the dry run and ``plan``."""
    return updates * samples_per_update / num_samples


def describe_schedule(cfg: Config) -> str:
    """The schedule in words, for ``plan`` and the dry run."""
    a, g = cfg.algo, cfg.rollout.group_size
    samples = a.prompts_per_phase * g
    made = passes(a.updates_per_phase, a.samples_per_update, samples)
    reuse = {"keep": f"{made:.2f} passes over the phase's samples, uniform groups kept at A = 0",
             "drop": f"{made:.2f} passes over the phase's samples, and 1 / (1 - the uniform "
                     f"fraction) times that over the rest once uniform groups are dropped",
             "drop_once": f"uniform groups dropped, then {min(made, 1.0):.2f} passes over the "
                          f"rest in updates of (1 - the uniform fraction) x "
                          f"{a.samples_per_update}"}[a.uniform_groups]
    return (f"{a.num_phases} phases x mu={a.updates_per_phase} updates = {a.total_updates} updates "
            f"and {a.num_phases} weight syncs; each phase {a.prompts_per_phase} prompts x G={g} = "
            f"{samples} responses, {a.samples_per_update} per update ({reuse})")

"""The phase schedule: which prompts each phase generates for, how long it runs, and which samples
each of its updates uses.

Pure and deterministic (seeded): no process groups, no model. GRPO (mu = 4) and Mu-GRPO
(mu = 1024) are two settings of the same scheduler: ``total_updates / mu`` phases of ``mu``
updates. With ``algo.max_drift`` a phase ends early once the policy has drifted that far from its
behaviour policy (``DriftBound``), so the phases are planned one at a time from the ones that
ended (``PhaseScheduler.plan``): the next phase starts where the last ended, and generates for as
many updates as the recent phases ran (``planned_updates``), so that few of its rollouts go
unused. The ended phases (``PhaseEnd``, a few numbers each) and the running phase's drift window
are what a checkpoint keeps of the schedule (``state``), so a resume plans the same phases.

Within a phase the learner makes passes of ``samples_per_update`` samples over the phase's data:
the samples are shuffled anew each epoch and cut into minibatches; as many epochs as the phase's
updates take are made (a partial last epoch is normal). A minibatch never straddles two epochs,
so each epoch sees each sample at most once; the tail of an epoch shorter than a minibatch is left
for the next shuffle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from mugrpo_megatron.config import AlgoConfig, Config
from mugrpo_megatron.config.run import MIXTURE_BLOCK, source_name
from mugrpo_megatron.loss_metrics import ess_fractions

PLANNED_FROM = 2
"""A phase after the first generates for the longest of this many phases before it."""


@dataclass(frozen=True)
class Phase:
    """One generate-then-optimize phase, as planned when it starts."""

    index: int
    """0-based phase number."""
    first_update: int
    """Global index of the phase's first optimizer update."""
    max_updates: int
    """The most updates it runs: mu, or what is left of the run's total_updates."""
    planned_updates: int
    """The updates its generation is sized for (one pass of samples_per_update over its
    responses): max_updates, or with max_drift the updates the recent phases ran."""
    prompt_start: int
    """Position of its first prompt in the run's stream of prompts."""
    prompt_indices: tuple[int, ...]
    """Dataset rows this phase generates responses for."""

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_indices)

    def plan_record(self) -> dict[str, int]:
        """What identifies the plan (written beside the phase's rollouts, compared on resume)."""
        return {"index": self.index, "first_update": self.first_update,
                "max_updates": self.max_updates, "planned_updates": self.planned_updates,
                "prompt_start": self.prompt_start, "num_prompts": self.num_prompts}


@dataclass(frozen=True)
class PhaseEnd:
    """How a phase ended: part of the schedule's state, saved with every checkpoint."""

    index: int
    first_update: int
    updates: int
    """Updates it ran."""
    end: Literal["mu", "drift"]
    """'mu': it ran max_updates; 'drift': the drift bound ended it."""
    prompts: int
    """Prompts it generated for."""


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


class DriftBound:
    """``algo.max_drift``: whether the running phase has drifted too far to go on.

    The statistic is the mean, over the last ``drift_window`` updates of the phase, of each
    update's mean |log rho| over its response tokens (``abs_log_ratio_mean``: taken in the
    update's forward pass, before it steps, on samples it had not trained on in this pass, and
    the same on every rank after the update's one metric reduction). Mean |log rho| is the drift
    the miniature's held-out accuracy falls with (benchmarks/RESULTS.md); a KL estimate would need
    a second reduced number and says much the same at these sizes. Without a bound it never
    ends a phase."""

    def __init__(self, algo: AlgoConfig, window: Sequence[float] = ()):
        self.bound, self.size = algo.max_drift, algo.drift_window
        self.min_updates = algo.min_phase_updates
        self.window = list(window)[-self.size:]
        """The last updates' mean |log rho| (the checkpoint keeps it: a resume mid-phase ends the
        phase where the uninterrupted run did)."""

    def observe(self, step_in_phase: int, abs_log_ratio_mean: float) -> bool:
        """Take the update at ``step_in_phase``'s drift; True when the phase ends after it."""
        if self.bound is None:
            return False
        self.window = (self.window + [abs_log_ratio_mean])[-self.size:]
        return (step_in_phase + 1 >= self.min_updates and len(self.window) == self.size
                and self.drift >= self.bound)

    @property
    def drift(self) -> float:
        """The windowed drift now (NaN before the first update)."""
        return sum(self.window) / len(self.window) if self.window else math.nan


class AutoClip:
    """``algo.clip_high: auto``: each update's eps_high, from what the update before it measured.

    The rule, chosen before any run: the widest upper clip, up to the paper's relaxed 5, under
    which the ratios that weight the positive-advantage tokens' gradients keep an effective
    sample size of at least ``clip_high_auto_ess`` (0.5) of their number; never narrower than
    the grid's smallest (0.2: PPO's). An upper clip acts on A > 0 tokens alone (an A < 0 token's
    min picks its unclipped branch above 1 + eps), and capping their ratios at c trades bias for
    variance as truncated importance sampling does (Ionides 2008): while the capped weights keep
    half their effective sample size the variance stays within about twice an on-policy one's
    (the resampling threshold of Kong 1992), and the clip stays as wide as the paper's. The
    update before's ratios stand in for this update's (they differ by one step's drift, ~1e-3 in
    |log rho| here), so the rule costs no pass: the ESS at each candidate is summed in the loss
    and reduced with the update's other metrics, the same on every rank whatever the layout. A
    phase's first update takes the widest (its ratios are all 1: ESS = 1)."""

    def __init__(self, algo: AlgoConfig, saved: float | None = None):
        self.grid, self.ess_min = algo.clip_high_auto_grid, algo.clip_high_auto_ess
        self.clip = self.grid[-1] if saved is None else saved
        """The next update's eps_high (the checkpoint keeps it: a resume mid-phase goes on
        with the clip the uninterrupted run had)."""

    def observe(self, metrics: dict[str, float]) -> None:
        """Take an update's combined metrics (``policy_loss(ess_grid=...)``): log the clip it
        ran with and its ESS at each candidate in ``metrics``, and set the next clip."""
        fractions = ess_fractions(metrics, self.grid)
        for i in range(len(self.grid)):
            metrics.pop(f"ess_capped_mean_{i}", None)
            metrics.pop(f"ess_capped_sq_mean_{i}", None)
        metrics["clip_high"] = self.clip
        for eps, f in zip(self.grid, fractions):
            if f is not None:
                metrics[f"ess_clip_{eps:g}"] = f
        if any(f is not None for f in fractions):  # else (no A > 0 token) as it was
            ok = [eps for eps, f in zip(self.grid, fractions) if f is not None
                  and f >= self.ess_min]
            self.clip = max(ok) if ok else self.grid[0]


class PhaseScheduler:
    """Phases and minibatches for ``algo.total_updates`` updates of at most ``algo.updates_per_phase``
    (mu) a phase.

    Built from the config, which has checked every schedule setting (``AlgoConfig``, ``Config``);
    only the data set's size is new here."""

    def __init__(self, algo: AlgoConfig, group_size: int, num_prompts: int,
                 file_sizes: Sequence[int] = (), weights: Sequence[float] | None = None):
        """``file_sizes``: the kept prompts of each file of a mixture, in order (their sum is
        ``num_prompts``), drawn from by ``weights`` (``data.weights``; None: as one set)."""
        if num_prompts < 1:
            raise ValueError("the prompt dataset is empty")
        self.mixture = None
        if weights is not None and len(file_sizes) > 1:
            if sum(file_sizes) != num_prompts or len(weights) != len(file_sizes):
                raise ValueError(f"a mixture of {len(file_sizes)} files of {list(file_sizes)} "
                                 f"prompts, {num_prompts} in all, and {len(weights)} weights")
            if not all(file_sizes):
                raise ValueError(f"data.path: file {list(file_sizes).index(0)} of the mixture "
                                 f"has no usable prompt")
            self.mixture = Mixture(file_sizes, weights, algo.seed)
        self.algo = algo
        self.num_phases = algo.num_phases
        self.updates_per_phase = algo.updates_per_phase
        self.prompts_per_phase = algo.prompts_per_phase
        self.group_size = group_size
        self.samples_per_update = algo.samples_per_update
        self.num_prompts = num_prompts
        self.seed = algo.seed

    def plan(self, ended: Sequence[PhaseEnd]) -> Phase | None:
        """The phase after the ``ended`` ones (in order), or None when they ran every update.

        It starts at the update and prompt where they stopped. It generates for
        ``planned_updates``: mu (``prompts_per_phase`` prompts) for the first phase, and as long
        as no phase ended early; after an early end, the longest of the last ``PLANNED_FROM``
        phases, at ``prompts_per_phase / mu`` prompts an update (at least one update's worth).
        Never more than ``max_updates``."""
        first = sum(e.updates for e in ended)
        if first >= self.algo.total_updates:
            return None
        max_updates = min(self.updates_per_phase, self.algo.total_updates - first)
        planned = max_updates
        if self.algo.max_drift is not None and any(e.end == "drift" for e in ended):
            planned = min(max_updates, max(e.updates for e in ended[-PLANNED_FROM:]))
        num = phase_prompts(self.algo, self.group_size, planned)
        start = sum(e.prompts for e in ended)
        return Phase(index=len(ended), first_update=first, max_updates=max_updates,
                     planned_updates=planned, prompt_start=start,
                     prompt_indices=self._prompts(start, num))

    def unseen_sources(self, sources_of: Callable[[Sequence[int]], Sequence[str]],
                       all_sources: Sequence[str]) -> list[str]:
        """The prompt set's sources (``all_sources``) that no prompt the run draws has (as
        planned without early ends, ``run_draws``), where the run draws at most one mixture
        block (``MIXTURE_BLOCK``); [] for a longer run, whose draws follow the weights.
        ``sources_of(indices)``: the sources of those prompts (at most a block of reads)."""
        draws = run_draws(self.algo, self.group_size)
        if draws > MIXTURE_BLOCK:
            return []
        seen = set(sources_of(self._prompts(0, draws)))
        return [s for s in all_sources if s not in seen]

    def phase(self, index: int) -> Phase:
        """Phase ``index`` of the schedule without early ends (every phase runs mu updates)."""
        if not 0 <= index < self.num_phases:
            raise IndexError(f"phase {index} out of range [0, {self.num_phases})")
        mu, ppp = self.updates_per_phase, self.prompts_per_phase
        phase = self.plan([PhaseEnd(i, i * mu, mu, "mu", ppp) for i in range(index)])
        assert phase is not None
        return phase

    def phases(self) -> Iterator[Phase]:
        """Every phase of the schedule without early ends."""
        for i in range(self.num_phases):
            yield self.phase(i)

    def _prompts(self, start: int, num: int) -> tuple[int, ...]:
        """Dataset rows at positions [start, start + num) of the run's prompt stream: a seeded
        order, reshuffled at each pass over the dataset, so consecutive phases see fresh prompts
        until the dataset is used up (a weighted mixture: ``Mixture``)."""
        if self.mixture is not None:
            return self.mixture.prompts(start, num)
        prompts: list[int] = []
        perms: dict[int, torch.Tensor] = {}
        for pos in range(start, start + num):
            data_epoch, offset = divmod(pos, self.num_prompts)
            if data_epoch not in perms:
                perms[data_epoch] = self._permutation(self.num_prompts, 0, data_epoch)
            prompts.append(int(perms[data_epoch][offset]))
        return tuple(prompts)

    def prompt_index(self, phase: Phase, position: int) -> int:
        """The prompt set's index of ``phase``'s prompt at ``position``: one of its planned
        prompts, or past them (``uniform_groups: refill``) the run's next ones."""
        if position < phase.num_prompts:
            return phase.prompt_indices[position]
        return self._prompts(phase.prompt_start + position, 1)[0]

    def update_size(self, num_samples: int, once: bool, quantum: int = 1,
                    phase: Phase | None = None) -> int:
        """Samples an update takes: ``samples_per_update`` (all of them when the phase has fewer),
        or with ``once`` the phase's samples / its planned updates (mu without ``phase``), so
        that those updates are one pass; a multiple of ``quantum`` (the learner's DP x
        micro-batch) either way, and at least one quantum."""
        size = min(self.samples_per_update, num_samples)
        if once:
            planned = phase.planned_updates if phase is not None else self.updates_per_phase
            size = min(size, num_samples // planned)
        return max(quantum, size // quantum * quantum)

    def minibatches(self, phase: Phase, num_samples: int, size: int | None = None
                    ) -> Iterator[Minibatch]:
        """The phase's minibatches, at most ``phase.max_updates`` (the trainer stops early when
        the drift bound ends the phase), over ``num_samples`` samples (after any filtering), of
        ``size`` samples (default: ``samples_per_update``, or all when filtering left fewer)."""
        if num_samples < 1:
            raise ValueError(f"phase {phase.index} has no samples to train on")
        size = min(size or self.samples_per_update, num_samples)
        per_epoch = num_samples // size
        for step in range(phase.max_updates):
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


class Mixture:
    """The prompt stream of a mixture with ``data.weights``: position p of the run's stream is
    a prompt of one file, the files' shares of every block of ``MIXTURE_BLOCK`` positions
    exactly their weights' to within one prompt at the block's end (each block's counts by the
    largest remainder of what each file is owed so far), the files' turns in a block in seeded
    random order, and each file's own prompts in a seeded order reshuffled at every pass over
    it. Deterministic in the seed, the sizes and the weights: a resume draws the same prompts in
    the same order. Costs per call a few numbers a block up to the last position asked for
    (kept), and a permutation of each file per pass over it (int64: 8 MB at 10^6 prompts)."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int):
        self.sizes = list(sizes)
        self.offsets = [sum(self.sizes[:f]) for f in range(len(self.sizes))]
        total = sum(weights)
        self.shares = [w / total for w in weights]
        self.seed = seed
        self._drawn: list[list[int]] = [[0] * len(self.sizes)]
        """Draws of each file before each block (``_drawn[b]``), computed up to the last block
        asked for."""
        self._perms: dict[tuple[int, int], torch.Tensor] = {}
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _counts(self, b: int) -> list[int]:
        """Each file's draws in block ``b``: what it is owed by the block's end (its share of
        (b + 1) x MIXTURE_BLOCK) less what it drew before, floored, and the rest of the block to
        the largest remainders (ties to the first file)."""
        while len(self._drawn) <= b + 1:
            k = len(self._drawn) - 1
            owed = [(k + 1) * MIXTURE_BLOCK * q - d for q, d in zip(self.shares, self._drawn[k])]
            counts = [math.floor(x) for x in owed]
            for f in sorted(range(len(owed)), key=lambda f: (counts[f] - owed[f], f))[
                    :MIXTURE_BLOCK - sum(counts)]:
                counts[f] += 1
            self._drawn.append([d + c for d, c in zip(self._drawn[k], counts)])
        return [a - d for a, d in zip(self._drawn[b + 1], self._drawn[b])]

    def _perm(self, key: tuple[int, int], n: int) -> torch.Tensor:
        if key not in self._perms:
            stream, epoch = key
            mixed = (self.seed * 0x9E3779B1 + stream * 0x85EBCA6B + epoch * 0xC2B2AE35) % (1 << 63)
            self._perms[key] = torch.randperm(n, generator=torch.Generator().manual_seed(mixed))
        return self._perms[key]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s file at each slot (its turns in seeded order) and that draw's number
        among the file's draws over the run."""
        if b not in self._blocks:
            counts = self._counts(b)
            order = np.repeat(np.arange(len(counts)), counts)[
                self._perm((-1 - b, 0), MIXTURE_BLOCK).numpy()]
            draw = np.empty(MIXTURE_BLOCK, dtype=np.int64)
            for f in range(len(counts)):
                slots = np.flatnonzero(order == f)
                draw[slots] = self._drawn[b][f] + np.arange(len(slots))
            if len(self._blocks) >= 4:  # a phase's positions are consecutive: keep a few
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = (order, draw)
        return self._blocks[b]

    def draws(self, num: int) -> list[int]:
        """Each file's draws among the stream's first ``num`` positions (its sizes play no
        part: which file a position draws from depends on the weights and the seed only)."""
        b, rest = divmod(num, MIXTURE_BLOCK)
        self._counts(b)  # the blocks up to b laid out
        out = list(self._drawn[b])
        if rest:
            order, _ = self._block(b)
            out = [n + int((order[:rest] == f).sum()) for f, n in enumerate(out)]
        return out

    def prompts(self, start: int, num: int) -> tuple[int, ...]:
        """The kept-prompt indices at positions [start, start + num) of the stream."""
        out: list[int] = []
        for pos in range(start, start + num):
            b, slot = divmod(pos, MIXTURE_BLOCK)
            order, draw = self._block(b)
            f = int(order[slot])
            epoch, i = divmod(int(draw[slot]), self.sizes[f])
            out.append(self.offsets[f] + int(self._perm((1000 + f, epoch), self.sizes[f])[i]))
        return tuple(out)


@dataclass
class ScheduleState:
    """What a checkpoint keeps of the schedule: the phases that ended, and the running phase's
    drift window and automatic clip. JSON in ``state.json`` (a few numbers a phase)."""

    ended: list[PhaseEnd]
    drift_window: list[float]
    clip_high: float | None = None
    """``algo.clip_high: auto``: the running phase's next eps_high (``AutoClip``)."""

    def to_json(self) -> dict:
        return {"ended": [asdict(e) for e in self.ended], "drift_window": list(self.drift_window),
                "clip_high": self.clip_high}

    @classmethod
    def from_counters(cls, counters: dict, algo: AlgoConfig) -> ScheduleState:
        """The state a checkpoint saved (its ``schedule`` counter), or for a checkpoint from before
        drift-bounded schedules, the fixed schedule's phases up to its update."""
        saved = counters.get("schedule")
        if saved is not None:
            return cls([PhaseEnd(**e) for e in saved["ended"]], list(saved["drift_window"]),
                       saved.get("clip_high"))
        mu = algo.updates_per_phase
        return cls([PhaseEnd(i, i * mu, mu, "mu", algo.prompts_per_phase)
                    for i in range(counters["update"] // mu)], [])


def phase_prompts(algo: AlgoConfig, group_size: int, planned_updates: int) -> int:
    """Prompts a phase generated for ``planned_updates`` draws: prompts_per_phase in proportion
    to mu, and at least one update's worth."""
    num = math.ceil(algo.prompts_per_phase * planned_updates / algo.updates_per_phase)
    return max(num, math.ceil(algo.samples_per_update / group_size))


def run_draws(algo: AlgoConfig, group_size: int) -> int:
    """Prompts the run draws over all its phases, as planned without early ends (a drift bound
    plans its phases from how the last ended: about as many; refill draws more)."""
    draws, first = 0, 0
    while first < algo.total_updates:
        updates = min(algo.updates_per_phase, algo.total_updates - first)
        draws += phase_prompts(algo, group_size, updates)
        first += updates
    return draws


def mixture_coverage(cfg: Config) -> str:
    """For a mixture with ``data.weights``, whether the run draws enough prompts for them to
    hold, in words ('' when it does: more than a block of ``MIXTURE_BLOCK`` and every file
    drawn): each file's draws over the run against its weight's share, and the files (their
    sources and reward routes) it never draws."""
    d, a = cfg.data, cfg.algo
    if d.weights is None or len(d.paths) < 2:
        return ""
    draws = run_draws(a, cfg.rollout.group_size)
    got = Mixture([1] * len(d.paths), d.weights, a.seed).draws(draws)
    if draws >= MIXTURE_BLOCK and all(got):
        return ""
    total = sum(d.weights)
    each = ", ".join(f"{source_name(p)} {n} (weight's share {draws * w / total:.1f})"
                     for p, w, n in zip(d.paths, d.weights, got))
    text = (f"data.weights: the run draws {draws} prompts"
            + (" (more with uniform_groups: refill)" if a.uniform_groups == "refill" else "")
            + f"; the weights hold exactly over each block of {MIXTURE_BLOCK} draws"
            + (", and this run is shorter than one" if draws < MIXTURE_BLOCK else "")
            + f": it draws {each}")
    never = [i for i, n in enumerate(got) if not n]
    if never:
        text += ("; it never draws from " + ", ".join(f"data.path[{i}] ({d.paths[i]})"
                                                      for i in never)
                 + ", so their sources (each file's stem unless its rows name one in "
                   f"data.source_field {d.source_field!r}) and any reward.by_source route only "
                   "they use are never seen. Raise algo.total_updates or algo.prompts_per_phase, "
                   "or those files' weights")
    return text


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
                          f"{a.samples_per_update}",
             "refill": f"uniform groups dropped and refilled from further prompts (at most "
                       f"{a.max_refill_rounds} rounds), so {made:.2f} passes over informative "
                       f"groups"}[a.uniform_groups]
    phases = (f"{a.num_phases} phases x mu={a.updates_per_phase} updates = {a.total_updates} "
              f"updates and {a.num_phases} weight syncs")
    if a.max_drift is not None:
        phases = (f"{a.total_updates} updates in phases of {a.min_phase_updates} to "
                  f"mu={a.updates_per_phase} updates, each ended once the mean |log rho| of its "
                  f"last {a.drift_window} updates reaches max_drift = {a.max_drift:g}: "
                  f"{a.num_phases} to {a.max_phases} phases and weight syncs (an outcome); a "
                  f"phase after an early end generates for the updates the last "
                  f"{PLANNED_FROM} phases ran, at most the first phase's, so the largest phase "
                  f"is a full one (no device memory depends on a phase's size: its rollouts "
                  f"go to disk and each update reads its rows)")
    return (f"{phases}; each phase (of mu updates) {a.prompts_per_phase} prompts x G={g} = "
            f"{samples} responses, {a.samples_per_update} per update ({reuse})")

"""The paper miniature's rows and its sub-grids (``paper_miniature.py --grid NAME``), each of which
runs alone in under an hour on 2 cores.

A row is a training setting (schedule, clip, veto, drift bound); a grid is a regime (learning
rate, phase length M, phases, update size) and the rows it runs, each with its number of seeds.
Rows that carry a claim run at least 2 seeds, the headline rows (GRPO mu=4, Mu-GRPO) 3.

Two regimes:

- ``today``: the 4-phase regime of the last report (lr 1.5e-4, M = 64, 256 updates of 32), where
  Mu-GRPO drifts far within a phase. ``today-bounds`` runs Mu-GRPO with three drift bounds at one
  seed; ``today`` the headline rows and the bound chosen from it (``CHOSEN_BOUND``) at 3 seeds;
  ``today-scopes`` the prefix veto scope at two bounds and the two halves of the relaxed clip.
- ``calibrated``: lr and M chosen so that the tight clip's rates match the paper's (GRPO mu=4 at
  or below 0.1% of tokens, GRPO at large mu 0.3-0.8% at the end of a phase) while GRPO mu=4 still
  gains at least 0.1 held-out; chosen from GRPO rows only (``CALIBRATION``), before any Mu-GRPO
  row ran in it.

``veto-scopes``, ``uniform`` and ``phase-sweep`` are the earlier ablations (veto scopes,
uniform-group policies, phase counts) at today's regime, with 2 seeds a row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    large_mu: bool
    """mu = the grid's M (else 4: GRPO's)."""
    clip: tuple[float, float]
    """(clip_low, clip_high): [1 - low, 1 + high]."""
    veto: str | None
    """veto scope, None for no veto"""
    max_drift: float | None = None
    """algo.max_drift: a drift-bounded schedule."""
    prefix_bound: float | None = None
    """algo.veto_prefix_bound, for veto scope 'prefix'."""
    extra: tuple[tuple[str, object], ...] = ()
    """Further config overrides (key, value): the GRPO family's knobs of the ``recipes`` grid."""


GRPO4 = Row("grpo_mu4", "GRPO mu=4, [0.8, 1.2]", False, (0.2, 0.2), None)
GRPOM = Row("grpo_muM", "GRPO mu=M, [0.8, 1.2]", True, (0.2, 0.2), None)
NOVETO = Row("relaxed_noveto", "mu=M, [0, 5], no veto", True, (1.0, 4.0), None)
MUGRPO = Row("mugrpo", "Mu-GRPO: mu=M, [0, 5], suffix veto", True, (1.0, 4.0), "suffix")
MUGRPO_AUTO = Row("mugrpo_auto", "Mu-GRPO, eps_high auto (ESS >= 0.5), suffix veto", True,
                  (1.0, 4.0), "suffix", extra=(("algo.clip_high", "auto"),))
"""Mu-GRPO with ``algo.clip_high: auto`` (the paper's open question 2; the rule in
``phase.AutoClip``, chosen before any run): rows in the calibrated and today's (fast-drift)
regimes and on the code task."""
DAPO4 = Row("dapo_mu4", "DAPO-style GRPO mu=4: [0.8, 1.28], token-mean, overlong buffer, refill",
            False, (0.2, 0.28), None,
            extra=(("algo.overlong_buffer_tokens", 12), ("algo.overlong_penalty", 1.0),
                   ("algo.uniform_groups", "refill"), ("algo.max_refill_rounds", 4)))
"""DAPO (Yu et al. 2025) at mu = 4: clip-higher [1 - 0.2, 1 + 0.28], token-mean (ours already),
the soft overlong punishment over the last 20% of the response limit (DAPO: 4096 of 20480; here
12 of 64 tokens) and dynamic sampling (refill); no KL, as DAPO."""
DRGRPO4 = Row("drgrpo_mu4", "Dr.GRPO-style GRPO mu=4: [0.8, 1.2], no std, seq-mean-token-sum-norm",
              False, (0.2, 0.2), None,
              extra=(("algo.norm_adv_by_std", False),
                     ("algo.loss_agg", "seq-mean-token-sum-norm")))
"""Dr.GRPO (Liu et al. 2025): advantages without the group std, each response's token sum over
the response-length limit."""


ROWS = {r.name: r for r in [
    GRPO4, GRPOM, NOVETO,
    Row("veto_trigger", "mu=M, [0, 5], veto on triggers", True, (1.0, 4.0), "trigger"),
    MUGRPO,
    Row("veto_suffix_no_trigger", "mu=M, [0, 5], suffix minus triggers", True, (1.0, 4.0),
        "suffix_no_trigger"),
    Row("veto_sequence", "mu=M, [0, 5], whole sequence", True, (1.0, 4.0), "sequence"),
    # which side of the relaxed clip matters: the low side opened, or the high side
    Row("clip_low_open_veto", "mu=M, [0, 1.2], suffix veto", True, (1.0, 0.2), "suffix"),
    Row("clip_high_open_veto", "mu=M, [0.8, 5], suffix veto", True, (0.2, 4.0), "suffix"),
    DAPO4, DRGRPO4, MUGRPO_AUTO,
]}


def kl_behaviour_row(coef: float) -> Row:
    """Mu-GRPO with a KL penalty (k2: (log rho)^2 / 2, whose gradient is log rho) to the phase's
    behaviour policy, ``coef`` its weight."""
    return replace(MUGRPO, name=f"mugrpo_klb{coef:g}",
                   label=f"Mu-GRPO + KL to behaviour, beta={coef:g} (k2)",
                   extra=(("algo.kl_coef", coef), ("algo.kl_target", "behaviour"),
                          ("algo.kl_estimator", "k2")))


KL_DRIFTS = (0.05, 0.2)
"""The drifts (mean |log rho|) the two KL coefficients of ``recipes`` are set for, chosen from the
earlier grids before any KL row ran: 0.05, the drift bound whose Mu-GRPO came closest to GRPO
mu=4 in ``today`` (0.566 +- 0.008 against 0.628), and 0.2, about the drift unbounded Mu-GRPO
reaches late in a phase at today's regime (0.183). The rule: with k2 the penalty's gradient on
a token is beta x log rho and the policy term's is about |A| rho ~ 1 (advantages are
normalised), so beta = 1 / d balances the two at drift d: beta 20 and 5."""


def drift_row(bound: float) -> Row:
    """Mu-GRPO with ``algo.max_drift`` = ``bound`` (phases of at most M updates)."""
    return replace(MUGRPO, name=f"mugrpo_drift{bound:g}",
                   label=f"Mu-GRPO, drift bound {bound:g} (mu <= M)", max_drift=bound)


def prefix_row(bound: float) -> Row:
    """Relaxed clip with the prefix veto scope at B = ``bound``."""
    return Row(f"veto_prefix{bound:g}", f"mu=M, [0, 5], prefix veto B={bound:g}", True,
               (1.0, 4.0), "prefix", prefix_bound=bound)


def row(name: str) -> Row:
    """A row by name: the fixed rows, ``mugrpo_drift<bound>``, ``veto_prefix<B>`` and
    ``mugrpo_klb<beta>``."""
    if name in ROWS:
        return ROWS[name]
    for prefix, make in (("mugrpo_drift", drift_row), ("veto_prefix", prefix_row),
                         ("mugrpo_klb", kl_behaviour_row)):
        if name.startswith(prefix):
            try:
                return make(float(name[len(prefix):]))
            except ValueError:
                break
    raise ValueError(f"unknown row {name!r}: one of {', '.join(ROWS)}, mugrpo_drift<bound> or "
                     f"veto_prefix<B>")


@dataclass(frozen=True)
class Grid:
    name: str
    what: str
    """What the grid tests, for its RESULTS.md section."""
    rows: tuple[tuple[Row, int], ...]
    """Each row with its seeds."""
    lr: float = 1.5e-4
    mu: int = 64
    """M: updates per phase of the large-mu rows."""
    phases: int = 4
    """Phases of the large-mu rows; every row makes phases x M updates."""
    samples_per_update: int = 32
    eval_every: int = 32
    uniform_policies: tuple[str, ...] = ("keep",)
    """algo.uniform_groups of each row (``uniform``: all three)."""
    phase_sweep: tuple[int, ...] = ()
    """Mu-GRPO at these phase counts, equal total updates (``phase-sweep``)."""

    @property
    def updates(self) -> int:
        return self.phases * self.mu


BOUNDS = (0.05, 0.08, 0.12)
"""The drift bounds ``today-bounds`` tries: the mean |log rho| Mu-GRPO reaches after ~18, ~28
and ~41 updates of a phase at today's regime (the last report's drift rate, ~0.003 an update),
so that its phases last about a quarter, a half and two thirds of M = 64."""
CHOSEN_BOUND = 0.08
"""The bound ``today`` runs at 3 seeds: the best held-out of ``today-bounds`` (one seed each)
among the bounds that make at most a quarter of GRPO mu=4's 64 syncs: 0.08 (15 syncs, held-out
0.486), against 0.12 (8 syncs, 0.483); 0.05 ended higher (0.570) with 18 syncs, over the
quarter, and runs at 3 seeds beside it. One seed each: the choice is read from noise-sized
differences, which the 3-seed rows of ``today`` then test."""
NEAR_BOUND = 0.05
"""The tighter bound of ``today-bounds``, also at 3 seeds in ``today`` (see CHOSEN_BOUND)."""
PREFIX_BOUNDS = (4.6, 9.21)
"""B of the prefix scope: the whole prefix may fall to a ratio of 1e-2, or of 1e-4 (the paper's
single-token threshold, applied to the prefix)."""
CALIBRATION = {"lr": 1e-5, "mu": 32, "phases": 4, "samples_per_update": 32}
"""The paper-calibrated regime (see ``calibrated``), read from GRPO rows alone (one seed each,
``--grid custom --rows grpo_mu4,grpo_muM``; benchmarks/RESULTS.md has the numbers): at lr 1e-5
GRPO mu=4 clips 0.001% of tokens and gains 0.15 held-out in 128 updates, and GRPO's tight clip
at mu = 64 clips 0.66% of tokens 24-32 updates into a phase (0.13% at 8-16, 1.2% at 48-64), so
M = 32; at 2e-5 to 5e-5 the tight clip reached 0.3-0.8% only 8-16 updates into a phase."""

GRIDS = {g.name: g for g in [
    Grid("today-bounds", "Mu-GRPO with three drift bounds, one seed each, to choose the bound "
                         "the 'today' grid runs at 3 seeds",
         tuple((drift_row(b), 1) for b in BOUNDS)),
    Grid("today", "the headline rows at today's regime, and Mu-GRPO with the chosen drift "
                  "bound (claim 1 with a bounded drift)",
         ((GRPO4, 3), (GRPOM, 3), (MUGRPO, 3), (drift_row(CHOSEN_BOUND), 3),
          (drift_row(NEAR_BOUND), 3))),
    Grid("today-scopes", "the prefix veto scope at two bounds, and which side of the relaxed "
                         "clip matters (with the suffix veto); no veto for reference",
         tuple((prefix_row(b), 2) for b in PREFIX_BOUNDS)
         + ((ROWS["clip_low_open_veto"], 2), (ROWS["clip_high_open_veto"], 2), (NOVETO, 2))),
    Grid("calibrated", "the paper-calibrated regime: the paper's three rows and the relaxed "
                       "clip without veto, read against its claims",
         ((GRPO4, 3), (GRPOM, 2), (NOVETO, 2), (MUGRPO, 3)), eval_every=16, **CALIBRATION),
    Grid("veto-scopes", "the veto scopes at today's regime (claim 3)",
         tuple((ROWS[n], 2) for n in ("relaxed_noveto", "veto_trigger", "mugrpo",
                                      "veto_suffix_no_trigger", "veto_sequence"))),
    Grid("uniform", "the headline rows under each uniform-group policy",
         ((GRPO4, 2), (MUGRPO, 2)), uniform_policies=("keep", "drop", "drop_once")),
    Grid("phase-sweep", "Mu-GRPO at 2, 4, 8 and 16 phases of equal total updates",
         (), phase_sweep=(2, 4, 8, 16)),
    Grid("calibrated-auto", "the automatic upper clip at the paper-calibrated regime, beside "
                            "Mu-GRPO's fixed [0, 5]",
         ((MUGRPO_AUTO, 3), (MUGRPO, 3)), eval_every=16, **CALIBRATION),
    Grid("today-auto", "the automatic upper clip at today's fast-drift regime, beside Mu-GRPO's "
                       "fixed [0, 5] and GRPO mu=4",
         ((MUGRPO_AUTO, 3), (MUGRPO, 3), (GRPO4, 3))),
    Grid("recipes", "the GRPO family's recipes on our loop at today's regime: GRPO mu=4 vanilla, "
                    "DAPO-style and Dr.GRPO-style, and Mu-GRPO with a KL trust region to the "
                    "behaviour policy at two coefficients",
         ((GRPO4, 2), (DAPO4, 2), (DRGRPO4, 2),
          *((kl_behaviour_row(1 / d), 2) for d in KL_DRIFTS), (MUGRPO, 2))),
]}
PHASE_SWEEP_SEEDS = 2

CODE_CALIBRATION = {"lr": 3e-5, "mu": 24, "phases": 5, "samples_per_update": 32}
"""The code task's regime (``paper_miniature.py --task code``), read from GRPO rows alone by
the math regime's criteria before any other row ran on the code task (benchmarks/RESULTS.md,
'Choosing the code task's regime'): at lr 1e-5 GRPO mu=4 gained 0.051 in 128 updates (under
0.1); at 3e-5 it gained 0.108, clipping 0.039% of tokens, and GRPO's tight clip at mu = 32
clipped 0.52% of tokens 16-24 updates into a phase (0.87% at 24-32), so M = 24, and 5 phases
(120 updates) to keep about the 128 updates over which mu=4 gained 0.1."""
CODE_GRIDS = {g.name: g for g in [
    Grid("code", "the veto beyond math (the paper's open question 3): the paper's three rows, "
                 "the relaxed clip without veto, and Mu-GRPO with the automatic upper clip on "
                 "the code task, 3 seeds a row",
         ((GRPO4, 3), (GRPOM, 3), (NOVETO, 3), (MUGRPO, 3), (MUGRPO_AUTO, 3)), eval_every=24,
         **CODE_CALIBRATION),
]}
"""The grids of ``--task code``."""

MUGRPO_NOTOOLS = Row("mugrpo_notools", "Mu-GRPO without tools (rollout.tools: [])", True,
                     (1.0, 4.0), "suffix", extra=(("rollout.tools", "[]"),))
"""Mu-GRPO on the tool task with the tool taken away: a call gets no answer, only guessing
pays (``--task tools``)."""
TOOLS_CALIBRATION = {"mu": 16, "phases": 2, "samples_per_update": 32}
"""The tool task's regime but its learning rate (``tools-calibrate`` chooses that from GRPO
mu=4 alone, before any other row runs on the task: the lr of {1e-4, 3e-4} with the larger
held-out gain at seed 0). 32 updates of 32 trajectories, Mu-GRPO in 2 phases of 16."""
TOOLS_LR = 1e-4
"""The learning rate ``tools-calibrate`` chose (benchmarks/RESULTS.md, 'Choosing the tool task's
learning rate'): GRPO mu=4 at seed 0 gained 0.258 held-out at 1e-4 (0.340 -> 0.598) and 0.199 at
3e-4 (0.340 -> 0.539)."""
TOOL_GRIDS = {g.name: g for g in [
    Grid("tools-calibrate", "the tool task's learning rate, from GRPO mu=4 alone at seed 0",
         ((GRPO4, 1),), lr=1e-4, eval_every=16, **TOOLS_CALIBRATION),
    Grid("tools", "Mu-GRPO where tools pay: GRPO mu=4, Mu-GRPO, and Mu-GRPO without tools on "
                  "two-digit multiplication with the python tool, 3 seeds a row",
         ((GRPO4, 3), (MUGRPO, 3), (MUGRPO_NOTOOLS, 3)), lr=TOOLS_LR, eval_every=8,
         **TOOLS_CALIBRATION),
]}
"""The grids of ``--task tools``."""


@dataclass(frozen=True)
class Job:
    """One training run: a row at one mu, uniform-group policy and seed."""

    row: Row
    mu: int
    uniform: str
    seed: int

    @property
    def key(self) -> str:
        """The setting (what the seeds of one table line share)."""
        return f"{self.row.name}_mu{self.mu}_{self.uniform}"

    @property
    def label(self) -> str:
        return self.row.label.replace("mu=M", f"mu={self.mu}").replace("<= M", f"<= {self.mu}")


def jobs_for(grid: Grid) -> tuple[list[Job], list[tuple[str, str, str, int]]]:
    """Every run of ``grid`` and its table's lines: (setting key, label, uniform policy,
    phases)."""
    jobs: dict[str, Job] = {}
    lines: list[tuple[str, str, str, int]] = []

    def add(r: Row, mu: int, uniform: str, seeds: int, phases: int) -> None:
        for seed in range(1, seeds + 1):
            job = Job(r, mu, uniform, seed)
            jobs.setdefault(f"{job.key}_s{seed}", job)
        job = Job(r, mu, uniform, 1)
        lines.append((job.key, job.label, uniform, phases))

    for uniform in grid.uniform_policies:
        for r, seeds in grid.rows:
            add(r, grid.mu if r.large_mu else 4, uniform, seeds,
                grid.phases if r.large_mu else grid.updates // 4)
    for phases in grid.phase_sweep:
        add(MUGRPO, grid.updates // phases, "keep", PHASE_SWEEP_SEEDS, phases)
    return list(jobs.values()), lines

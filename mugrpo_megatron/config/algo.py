"""Mu-GRPO's schedule, clipping and veto."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from mugrpo_megatron.config.section import Section
from mugrpo_megatron.objective import VETO_SCOPES


@dataclass(frozen=True)
class AlgoConfig(Section):
    _name: ClassVar[str] = "algo"

    total_updates: int = 4096
    """Optimizer updates in the whole run (the paper uses 4096 for both GRPO and Mu-GRPO)."""
    updates_per_phase: int = 1024
    """mu: optimizer updates per rollout refresh. 4 is standard GRPO; 1024 is Mu-GRPO's 4 phases.
    With max_drift, the most updates a phase runs."""
    prompts_per_phase: int = 1024
    """Prompts whose G responses are generated at the start of each phase (for mu updates; with
    max_drift a phase after the first generates for the updates the recent phases ran)."""
    max_drift: float | None = None
    """A drift-bounded schedule: end a phase, and start the next with a fresh generation, once
    the policy has drifted this far from the phase's behaviour policy, measured as the mean
    |log rho| over the response tokens of the last drift_window updates (each update's
    abs_log_ratio_mean, taken in its forward pass before it steps, so every rank has it: no
    collective is added). A phase runs at least min_phase_updates and at most mu updates; the
    run's total_updates stay, so the number of phases and weight syncs is an outcome. Each
    phase's record says how many updates it ran ('updates') and why it ended ('end': mu or
    drift). The bound must stand well above the train/inference gap (update 0's |log rho|:
    ~1e-6 in fp32, 1e-3 to 1e-2 in bf16). null: every phase runs mu updates. See README,
    'Choosing the schedule'."""
    drift_window: int = 4
    """Updates whose mean |log rho| the max_drift bound is compared with (smooths one update's
    noise)."""
    min_phase_updates: int = 4
    """With max_drift, the fewest updates a phase runs (no phase is a generation for nothing)."""
    samples_per_update: int = 256
    """Responses in one optimizer update (the minibatch), over all data-parallel ranks."""
    clip_low: float = 1.0
    """eps_low: the ratio is clipped below at 1 - clip_low (1.0 = no lower clip, as in [0, 5])."""
    clip_high: float = 4.0
    """eps_high: the ratio is clipped above at 1 + clip_high (4.0 = the paper's relaxed [0, 5])."""
    veto_threshold: float | None = 1e-4
    """Negative-advantage veto: a token of an A < 0 response whose ratio falls below this triggers
    it. null disables the veto."""
    veto_scope: Literal["none", "trigger", "suffix", "suffix_no_trigger", "sequence",
                        "prefix"] = "suffix"
    """Tokens removed once a veto triggers: 'suffix' is the paper's S_kappa (after the first
    trigger). 'prefix': a trust region on the prefix instead of a single-token trigger: in an
    A < 0 response, the tokens after the first position where the running sum of log rho falls
    below -veto_prefix_bound leave the loss (veto_threshold then only turns the veto on)."""
    veto_prefix_bound: float = 9.21
    """B of veto_scope 'prefix': the prefix's ratio pi_theta / pi_behav may fall to exp(-B)
    before the rest of the response leaves the loss; 9.21 = -log(1e-4), the single-token
    threshold's bound applied to the whole prefix."""
    adv_eps: float = 1e-6
    """eps in A = (r - mean) / (std + eps)."""
    uniform_groups: Literal["keep", "drop", "drop_once"] = "keep"
    """Groups whose G responses all got the same reward (A = 0 on every token). 'keep': trained
    on like any sample, each once a pass; they add nothing to the gradient but count in the token
    mean, which shrinks the step by their share (GRPO in TRL and verl). 'drop': left out, and the
    mu updates of samples_per_update draw from the rest, so each remaining sample is trained on
    1 / (1 - uniform fraction) times as often: staler than the paper's. 'drop_once': left out,
    and each update takes the rest / mu (a multiple of DP x micro_batch_size): one pass, smaller
    and noisier updates, nothing reused. Uniform groups are counted and logged either way, with
    the passes each phase made."""
    behaviour_logprobs: Literal["engine", "learner"] = "engine"
    """The behaviour policy's log-probs the ratios divide by. 'engine': the engine's, as it
    sampled (the paper's bypass; no extra pass). 'learner': the learner scores every response of
    a phase once, before its first update, with the weights the engine sampled from, and keeps
    them beside the engine's (rollouts/phase_N/behaviour_learner.arrow): one forward pass over
    the phase's tokens, about a third of a training pass over them. On GPUs in bf16, or with an
    FP8 engine, the two differ by 1e-3 or more a token, which moves ratios near the veto's
    trigger; the phase log has that gap over every token, and the seconds the pass took."""
    seed: int = 1234
    """Seed for prompt order, minibatch shuffling and the learner's initialisation."""

    def __post_init__(self) -> None:
        self._positive("total_updates", "updates_per_phase", "prompts_per_phase",
                       "samples_per_update", "adv_eps")
        if self.total_updates % self.updates_per_phase:
            self._fail("total_updates", f"must be a multiple of algo.updates_per_phase "
                                        f"({self.updates_per_phase})")
        if not 0 <= self.clip_low <= 1:
            self._fail("clip_low", "must be in [0, 1] (the lower ratio bound 1 - clip_low >= 0)")
        self._non_negative("clip_high")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            self._fail("veto_threshold", "must be in (0, 1) or null")
        if self.veto_scope not in VETO_SCOPES:  # the Literal above, for direct construction too
            self._fail("veto_scope", f"must be one of {list(VETO_SCOPES)}")
        self._positive("veto_prefix_bound", "drift_window", "min_phase_updates")
        if self.max_drift is not None:
            self._positive("max_drift")
            if self.min_phase_updates > self.updates_per_phase:
                self._fail("min_phase_updates", f"must be at most algo.updates_per_phase "
                                                f"({self.updates_per_phase})")

    @property
    def num_phases(self) -> int:
        """Phases of mu updates: the schedule's phases without max_drift, the fewest with it."""
        return self.total_updates // self.updates_per_phase

    @property
    def max_phases(self) -> int:
        """The most phases (and weight syncs) the run can make: with max_drift, each of them as
        short as min_phase_updates allows."""
        if self.max_drift is None:
            return self.num_phases
        return math.ceil(self.total_updates / self.min_phase_updates)

"""A phase's numbers, typed, as the phase log writes them (``metrics.jsonl``, kind 'phase').

Each part of a phase fills its own fields: the schedule (how long the phase ran and why it
ended), the switches between engine and learner, generation, the checks, optimization. A number
that was not measured in this phase (no evaluation inside it, no packing check after the first
phase) is None and left out of the record, not written as 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mugrpo_megatron.phase.batches import LogprobGap


@dataclass
class PhaseRecord:
    phase: int
    first_update: int
    planned_updates: int
    """Updates its generation was sized for."""
    updates: int = 0
    """Updates it ran (fewer than mu when the drift bound ended it)."""
    end: str = ""
    """Why it ended: 'mu' (it ran its updates) or 'drift' (``algo.max_drift``)."""
    drift: float | None = None
    """The drift statistic when it ended (mean |log rho| over the last drift_window updates)."""
    # engine <-> learner
    sync_seconds: float = 0.0
    """Resharding the learner's weights into the engine."""
    switch_seconds: float = 0.0
    """Engine sleep/wake and learner offload/onload."""
    offload_seconds: float | None = None
    onload_seconds: float | None = None
    offload_gib: float | None = None
    # generation
    generate_seconds: float = 0.0
    score_seconds: float = 0.0
    """Rank 0's replica leader, blocked on its reward pool."""
    generate_tokens_per_s: float | None = None
    generated_groups: int = 0
    """Groups this start generated (a resumed phase: only those not on disk)."""
    refill_groups: int = 0
    """Of them, past the phase's planned prompts (``uniform_groups: refill``)."""
    refill_rounds: int = 0
    """Refill rounds, the most any replica made."""
    rollout_shards: int = 0
    reward_timeouts: int = 0
    reward_errors: int = 0
    reward_failures_by_source: dict[str, int] | None = None
    """Responses whose reward failed (errors and timeouts; each scored 0), by source."""
    reward_failure_examples: list[str] | None = None
    """The first few failures: source, data row and error."""
    inflight_prompts: int = 0
    # checks and the behaviour pass
    logprob_gap_mean: float | None = None
    logprob_gap_max: float | None = None
    pack_check_gap_mean: float | None = None
    pack_check_gap_max: float | None = None
    behaviour_seconds: float | None = None
    behaviour_gap_mean: float | None = None
    behaviour_gap_max: float | None = None
    rollout_correction: dict[str, float] | None = None
    """The correction of the engine's sampling over the phase's tokens (``algo.rollout_is`` /
    ``rollout_rs``, measured in the behaviour pass: ``rollout_correction.CorrectionStats``): the
    mean TIS weight and its truncated share, the shares of tokens and responses MIS rejected."""
    reference_seconds: float | None = None
    """The reference policy's pass over the phase's tokens (``algo.kl_target: reference``)."""
    reference_swaps: int | None = None
    """Times its weights were swapped into the learner's for that pass (one a phase)."""
    reference_gap_mean: float | None = None
    """|reference log-prob - behaviour log-prob| over the phase's tokens: how far the phase's
    behaviour policy is from the one the run started from."""
    reference_gap_max: float | None = None
    check_seconds: float = 0.0
    """The train/inference gap and packing checks (learner forwards of a few rows)."""
    wall_seconds: float = 0.0
    """The whole phase, from its plan to its record, without the held-out evaluations inside
    it: what the parts above and the phase's own overhead (opening, writing and indexing its
    files, plans, checkpoints) add up to."""
    # optimization
    optimize_seconds: float = 0.0
    """The updates, without the held-out evaluations inside the phase."""
    batch_read_seconds: float = 0.0
    """Reading the updates' rows from the shards (inside optimize_seconds)."""
    eval_seconds: float | None = None
    save_seconds: float = 0.0
    """Checkpoints saved in the phase (``checkpoint.save_every_updates``, and at its end with
    ``checkpoint.save_at_phase_end``)."""
    skipped_updates: int = 0
    passes: float = 0.0
    """Passes over the phase's train rows that its updates made."""
    uniform_policy: str = ""
    unused_frac: float = 0.0
    """The share of the phase's responses no update drew: generated for nothing."""
    unused_generate_seconds: float = 0.0
    """Their share of the generation time."""

    def set_gap(self, prefix: str, gap: LogprobGap | None) -> None:
        """``{prefix}_mean`` and ``{prefix}_max`` from a log-prob gap (left out when None)."""
        if gap is not None:
            setattr(self, f"{prefix}_mean", gap.mean)
            setattr(self, f"{prefix}_max", gap.max)

    def values(self) -> dict[str, Any]:
        """The record's fields, those not measured left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}

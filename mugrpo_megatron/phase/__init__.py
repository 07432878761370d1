"""A phase of Mu-GRPO and everything about its data, in the order a phase runs:

- ``schedule``: which prompts a phase generates for, how many updates it runs (with
  ``algo.max_drift``, until the policy has drifted that far), which samples each update takes;
- ``generation``: every engine replica streams its share of the prompts, its leader scores and
  persists whole groups; rank 0 indexes the phase (advantages, once);
- ``store``: the phase on disk (Arrow shards, the index with the advantages, the plan);
- ``data``: ``PhaseData``, the view each rank trains on, which yields each update's batch for
  that rank, and the log-prob files the learner writes beside the shards;
- ``checks``: what the learner scores besides training (the train/inference gap, packed against
  padded, the learner's behaviour log-probs);
- ``batches``: padded batches from rows, and the log-prob gap;
- ``record``: the phase's numbers, typed, for the phase log;
- ``viewer``: the ``rollouts`` command.

The trainer puts generation, checks and updates in order; the names it uses are these.
"""

from mugrpo_megatron.phase.batches import LogprobGap
from mugrpo_megatron.phase.checks import (
    check_packing,
    mismatch_gap,
    score_behaviour,
    score_reference,
)
from mugrpo_megatron.phase.data import PhaseData
from mugrpo_megatron.phase.generation import GenerationFailed, generate_phase
from mugrpo_megatron.phase.record import PhaseRecord
from mugrpo_megatron.phase.refill import Refill
from mugrpo_megatron.phase.schedule import (
    AutoClip,
    DriftBound,
    Phase,
    PhaseEnd,
    PhaseScheduler,
    ScheduleState,
)
from mugrpo_megatron.phase.store import Advantages, is_generated, phase_dir, record_plan

__all__ = ["Advantages", "AutoClip", "DriftBound", "GenerationFailed", "LogprobGap", "Phase",
           "PhaseData", "PhaseEnd", "PhaseRecord", "PhaseScheduler", "Refill", "ScheduleState",
           "check_packing", "generate_phase", "is_generated", "mismatch_gap", "phase_dir",
           "record_plan", "score_behaviour", "score_reference"]

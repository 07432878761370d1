"""Run configuration: frozen dataclasses, one per concern (``config.loader`` builds them from YAML
with dotted overrides).

Every field has a docstring under it (``python -m mugrpo_megatron config`` prints them).
Loading checks types and rejects unknown keys; each section validates its own values in
``__post_init__``; ``layout.check_layout`` validates the layout for a world size and a model.
All of this runs before any process group exists, and every error names the key and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mugrpo_megatron.config.algo import AlgoConfig
from mugrpo_megatron.config.learner import ModelConfig, OptimConfig, ParallelConfig
from mugrpo_megatron.config.rollout import RolloutConfig
from mugrpo_megatron.config.run import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    RewardConfig,
)

__all__ = ["AlgoConfig", "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "LoggingConfig",
           "ModelConfig", "OptimConfig", "ParallelConfig", "RewardConfig", "RolloutConfig"]


@dataclass(frozen=True)
class Config:
    """A whole run: one object, built from YAML, validated before any process group exists."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The learner's parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine and its sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Mu-GRPO: schedule, clipping, veto."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """How the held-out sets are sampled and reported."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, resuming and exporting."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where and how progress is reported."""

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a phase can hold: the longest prompt and the longest response."""
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

    @property
    def eval_max_new_tokens(self) -> int:
        """The longest held-out response (``eval.max_new_tokens``, or a rollout's)."""
        return self.eval.max_new_tokens or self.rollout.max_new_tokens

    @property
    def engine_max_len(self) -> int:
        """The longest sequence an engine serves: a phase's, or a held-out one's."""
        return self.data.max_prompt_tokens + max(self.rollout.max_new_tokens,
                                                 self.eval_max_new_tokens)

    @property
    def loss_agg_norm(self) -> float:
        """The constant of ``algo.loss_agg: seq-mean-token-sum-norm``: ``algo.loss_agg_norm``,
        or the response-length limit."""
        return self.algo.loss_agg_norm or float(self.rollout.max_new_tokens)

    def __post_init__(self) -> None:
        if self.rollout.tools and "tools" not in self.data.chat_template_kwargs:
            # the prompts are rendered with the tools' schemas (the template's tool section),
            # and the prompt file's key and the run's fingerprint follow them (data.*)
            from mugrpo_megatron.trajectory.tools import resolve_tools

            kwargs = {**self.data.chat_template_kwargs,
                      "tools": [t.schema for t in resolve_tools(self.rollout.tools)]}
            object.__setattr__(self, "data", replace(self.data, chat_template_kwargs=kwargs))
        sets = self.data.eval_sets
        for name in self.eval.samples_by_set:
            if name not in sets:
                raise ValueError(f"eval.samples_by_set.{name}: no held-out set of that name "
                                 f"(data.eval_path's sets: {', '.join(sets) or 'none'})")
        most = max([self.eval.samples_for(n) for n in sets] or [self.eval.samples])
        for k in self.eval.pass_k:
            if k > most:
                raise ValueError(f"eval.pass_k: {k} is more than any held-out set samples a "
                                 f"prompt ({most}: eval.samples, eval.samples_by_set)")
        if self.algo.overlong_buffer_tokens >= self.rollout.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer_tokens: {self.algo.overlong_buffer_tokens} "
                             f"must be below rollout.max_new_tokens "
                             f"({self.rollout.max_new_tokens}): the punishment starts that many "
                             f"tokens before the limit")
        if not self.checkpoint.save_at_phase_end and self.algo.max_drift is not None:
            raise ValueError(
                "checkpoint.save_at_phase_end: false needs phases of a fixed length, and "
                "algo.max_drift ends them where the updates' drift says: a resume from inside a "
                "phase would replay that decision, which on GPUs need not come out the same, and "
                "the next phase's rollouts on disk were planned from the first one. Keep "
                "save_at_phase_end: true with max_drift")
        pack = self.parallel.pack_tokens
        if pack != "auto" and 0 < pack < self.max_sequence_tokens:
            raise ValueError(f"parallel.pack_tokens: {pack} tokens cannot hold the longest "
                             f"sequence, data.max_prompt_tokens + rollout.max_new_tokens = "
                             f"{self.max_sequence_tokens}; raise it, or 0 to pad")
        samples_per_phase = self.algo.prompts_per_phase * self.rollout.group_size
        if self.algo.samples_per_update > samples_per_phase:
            raise ValueError(
                f"algo.samples_per_update: {self.algo.samples_per_update} is more than a phase "
                f"generates (algo.prompts_per_phase x rollout.group_size = {samples_per_phase})"
            )

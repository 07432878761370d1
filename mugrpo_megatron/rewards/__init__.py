"""Rewards: a registry of reward functions (``registry``) and a scorer that runs them in a
killable process pool (``scorer``)."""

from mugrpo_megatron.rewards.registry import (
    RewardFn,
    RewardSpec,
    register_reward,
    registered_rewards,
    resolve_reward,
)
from mugrpo_megatron.rewards.scorer import (
    PendingScores,
    RewardOutcome,
    RewardScorer,
    RowInfo,
    reward_specs,
)

__all__ = ["PendingScores", "RewardFn", "RewardOutcome", "RewardScorer", "RewardSpec", "RowInfo",
           "register_reward", "registered_rewards", "resolve_reward", "reward_specs"]

"""Rewards: a registry of reward functions (``registry``) and a scorer that runs them in a
killable process pool (``scorer``)."""

from mugrpo_megatron.rewards.registry import (
    RewardFn,
    register_reward,
    registered_rewards,
    resolve_reward,
)
from mugrpo_megatron.rewards.scorer import PendingScores, RewardOutcome, RewardScorer

__all__ = ["PendingScores", "RewardFn", "RewardOutcome", "RewardScorer", "register_reward",
           "registered_rewards", "resolve_reward"]

"""Held-out evaluation: the engine answers, the reward scores (pass@1, mean@k, pass@k)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mugrpo_megatron.rewards import RewardScorer
from mugrpo_megatron.types import Generation, Prompt, SamplingSpec

if TYPE_CHECKING:
    from mugrpo_megatron.engines.base import RolloutEngine


@dataclass(frozen=True)
class EvalResult:
    num_prompts: int
    k: int
    mean_at_k: float
    """Mean reward over all k x prompts responses (pass@1 estimated from k samples)."""
    pass_at_k: float
    """Fraction of prompts with at least one response of reward 1."""
    mean_response_tokens: float
    num_timeouts: int

    def as_dict(self) -> dict[str, float]:
        return {"eval_mean_at_k": self.mean_at_k, "eval_pass_at_k": self.pass_at_k,
                "eval_k": self.k, "eval_prompts": self.num_prompts,
                "eval_response_tokens": self.mean_response_tokens,
                "eval_reward_timeouts": self.num_timeouts}


def eval_sampling(*, k: int, max_new_tokens: int, temperature: float = 1.0, seed: int = 0
                  ) -> SamplingSpec:
    """k responses per prompt, greedy when k == 1."""
    return SamplingSpec(n=k, max_new_tokens=max_new_tokens,
                        temperature=0.0 if k == 1 else temperature, seed=seed)


def score_eval(gens: Sequence[Sequence[Generation]], prompts: Sequence[Prompt],
               scorer: RewardScorer, tokenizer) -> EvalResult:
    """Score each prompt's k responses with the training reward."""
    k = len(gens[0]) if gens else 1
    texts, answers, lengths = [], [], []
    for prompt, group in zip(prompts, gens):
        for g in group:
            texts.append(tokenizer.decode(list(g.token_ids), skip_special_tokens=True))
            answers.append(prompt.answer)
            lengths.append(len(g.token_ids))
    outcome = scorer.score(texts, answers)
    rewards = outcome.rewards
    solved = [max(rewards[i * k:(i + 1) * k]) >= 1.0 for i in range(len(prompts))]
    n = max(len(rewards), 1)
    return EvalResult(num_prompts=len(prompts), k=k, mean_at_k=sum(rewards) / n,
                      pass_at_k=sum(solved) / max(len(prompts), 1),
                      mean_response_tokens=sum(lengths) / n, num_timeouts=outcome.num_timeouts)


def evaluate(engine: RolloutEngine, scorer: RewardScorer, tokenizer, prompts: Sequence[Prompt], *,
             k: int, max_new_tokens: int, temperature: float = 1.0, seed: int = 0) -> EvalResult:
    """k responses per prompt (greedy when k == 1) from one engine, scored with the training
    reward."""
    spec = eval_sampling(k=k, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return score_eval(engine.generate([p.token_ids for p in prompts], spec), prompts, scorer,
                      tokenizer)

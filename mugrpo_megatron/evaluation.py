"""Held-out evaluation: the engine answers, the reward scores (pass@1, mean@k, pass@k); and the
``eval`` command, which does it for a checkpoint on a benchmark file."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mugrpo_megatron import outputs
from mugrpo_megatron.config import Config, ParallelConfig
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


def evaluate_checkpoint(cfg: Config, model: Path, *, data: str | None, limit: int, samples: int,
                        output: str | None = None, overwrite: bool = False) -> dict:
    """The ``eval`` command: ``samples`` responses a problem of ``data`` (default
    ``data.eval_path``; at most ``limit``) from the checkpoint ``model`` (an HF directory, or a
    Megatron checkpoint of ours, converted to HF in a temporary directory first: a directory
    either way, which the caller checked), scored with
    ``cfg.reward``; the result as a dict, also written to ``output`` as JSON."""
    if output:
        outputs.check_destination(output, [model], overwrite=overwrite, what="--output",
                                  directory=False)
    with tempfile.TemporaryDirectory() as tmp:
        hf = model
        if (model / "state.json").is_file() or (model / ".metadata").is_file():
            # a Megatron checkpoint (complete or not: loading names what is wrong): to HF first
            from mugrpo_megatron.learner.convert import megatron_to_hf

            hf = Path(tmp) / "hf"
            megatron_to_hf(model, hf, ParallelConfig(distributed_optimizer=False), cfg.model.dtype)
        from transformers import AutoTokenizer

        from mugrpo_megatron.data import load_prompts
        from mugrpo_megatron.engines import make_engine
        from mugrpo_megatron.rewards import RewardScorer

        tokenizer = AutoTokenizer.from_pretrained(hf, trust_remote_code=cfg.model.trust_remote_code)
        data_cfg = cfg.data if data is None else replace(cfg.data, eval_path=data, eval_size=limit)
        prompts, report = load_prompts(data_cfg, tokenizer, held_out=True)
        print(f"[eval] {report.summary()}")
        engine = make_engine(cfg.rollout, hf, dtype=cfg.model.dtype,
                             max_model_len=cfg.max_sequence_tokens,
                             trust_remote_code=cfg.model.trust_remote_code)
        try:
            with RewardScorer(cfg.reward) as scorer:
                res = evaluate(engine, scorer, tokenizer, prompts, k=samples,
                               max_new_tokens=cfg.rollout.max_new_tokens,
                               temperature=cfg.rollout.temperature, seed=cfg.rollout.seed)
        finally:
            engine.shutdown()
    out = {"model": str(model), "data": str(data_cfg.eval_path),
           "pass@1" if samples == 1 else f"mean@{samples}": res.mean_at_k,
           f"pass@{samples}": res.pass_at_k, **res.as_dict()}
    if output:
        outputs.write_file(output, json.dumps(out, indent=1))
    return out

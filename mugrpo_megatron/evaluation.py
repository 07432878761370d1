"""Held-out evaluation: named sets, each sampled with its own number of responses a prompt, scored
with the training reward, and reported as pass@k (the unbiased estimator) and mean@k, by set and
by source within a set; and the ``eval`` command, which does it for a checkpoint.

pass@k is Chen et al. (2021)'s unbiased estimator from n >= k samples a problem with c correct:
1 - C(n - c, k) / C(n, k), averaged over problems (a sample is correct when its reward is at
least 1, the math rewards' 1.0). mean@k, the mean reward of k samples a problem, has the same
expectation for every k: the set's mean reward over its n samples (verl's mean@N), reported at
each k beside pass@k.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mugrpo_megatron import outputs
from mugrpo_megatron.config import Config, ParallelConfig
from mugrpo_megatron.rewards import RewardScorer, RowInfo
from mugrpo_megatron.rewards.scorer import describe_failures
from mugrpo_megatron.trajectory import ToolSetup, model_text, tool_rows
from mugrpo_megatron.types import Generation, Prompt, SamplingSpec

if TYPE_CHECKING:
    from mugrpo_megatron.engines.base import RolloutEngine

CORRECT = 1.0
"""The reward at which a held-out sample counts as correct for pass@k."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k of one problem: 1 - C(n - c, k) / C(n, k), computed
    as a product (no large binomials): 1 - prod_{i = n - c + 1}^{n} (1 - k / i)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class EvalResult:
    """One held-out set's scores (and its sources', when it has several)."""

    num_prompts: int
    samples: int
    """n: responses a prompt."""
    mean_reward: float
    """Mean reward over every response (mean@k for every k)."""
    pass_at: dict[int, float]
    """pass@k by k (the unbiased estimator)."""
    mean_response_tokens: float
    num_timeouts: int
    num_errors: int = 0
    """Responses whose reward function failed (each scored 0; timeouts are ``num_timeouts``)."""
    failed_by_source: dict[str, int] = field(default_factory=dict)
    """Failed responses (errors and timeouts) by source."""
    failure_examples: list[str] = field(default_factory=list)
    """The first few failures: source, data row and error."""
    by_source: dict[str, EvalResult] = field(default_factory=dict)
    """The same for each source of a set that has several."""
    tool_use: dict[str, float] = field(default_factory=dict)
    """With tools (``rollout.tools``): model turns and tool calls a response, and the share of
    calls that failed ('turns', 'tool_calls', 'tool_error_frac'); empty without."""
    responses: list[dict] = field(default_factory=list, repr=False)
    """Every response with its prompt and reward (``write_samples``; not in ``as_dict``)."""

    @property
    def num_failed(self) -> int:
        return self.num_errors + self.num_timeouts

    def describe_failures(self) -> str:
        """The set's reward failures in one line ('' when none failed)."""
        if not self.num_failed:
            return ""
        return describe_failures(self.num_failed, self.num_prompts * self.samples,
                                 self.failed_by_source, self.failure_examples)

    def as_dict(self) -> dict:
        out = {"prompts": self.num_prompts, "samples": self.samples,
               **{f"mean@{k}": self.mean_reward for k in self.pass_at},
               **{f"pass@{k}": v for k, v in self.pass_at.items()},
               "response_tokens": self.mean_response_tokens, "reward_timeouts": self.num_timeouts,
               "reward_errors": self.num_errors}
        if self.num_failed:
            out["reward_failures_by_source"] = dict(self.failed_by_source)
            out["reward_failure_examples"] = list(self.failure_examples)
        if self.by_source:
            out["by_source"] = {s: r.as_dict() for s, r in self.by_source.items()}
        return {**out, **self.tool_use}

    def summary(self) -> str:
        """The set's scores in one line (and its tool use, with tools)."""
        t = self.tool_use
        tools = (f"; {t['turns']:.2f} turns and {t['tool_calls']:.2f} tool calls a response, "
                 f"{t['tool_error_frac']:.0%} of calls failed" if t else "")
        return (f"mean@{self.samples} {self.mean_reward:.3f}, "
                + ", ".join(f"pass@{k} {v:.3f}" for k, v in self.pass_at.items())
                + f" on {self.num_prompts} prompts{tools}")


def eval_sampling(*, k: int, max_new_tokens: int, temperature: float | None = None,
                  top_p: float = 1.0, seed: int = 0) -> SamplingSpec:
    """k responses per prompt, greedy when k == 1 and no temperature is given."""
    if temperature is None:
        temperature = 0.0 if k == 1 else 1.0
    return SamplingSpec(n=k, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p if temperature > 0 else 1.0, seed=seed)


def set_sampling(cfg: Config, name: str) -> SamplingSpec:
    """How held-out set ``name`` is sampled (``eval.*``; rollout's temperature where none is
    given and a prompt gets several samples)."""
    n = cfg.eval.samples_for(name)
    temperature = cfg.eval.temperature
    if temperature is None and n > 1:
        temperature = cfg.rollout.temperature
    return eval_sampling(k=n, max_new_tokens=cfg.eval_max_new_tokens, temperature=temperature,
                         top_p=cfg.eval.top_p, seed=cfg.rollout.seed)


def reported_k(cfg: Config, n: int) -> list[int]:
    """The k reported for a set of n samples a prompt: ``eval.pass_k``'s that are at most n, or
    1 and n."""
    ks = [k for k in cfg.eval.pass_k if k <= n] if cfg.eval.pass_k else [1, n]
    return sorted(set(ks))


def score_eval(gens: Sequence[Sequence[Generation]], prompts: Sequence[Prompt],
               scorer: RewardScorer, tokenizer, ks: Sequence[int], tools: bool = False
               ) -> EvalResult:
    """Score each prompt's n responses with the training reward (routed by source, given the
    row as in training); pass@k for each k of ``ks``, overall and by source; with ``tools``
    (the responses are trajectories), their tool use."""
    texts, answers, rows, lengths = [], [], [], []
    for prompt, group in zip(prompts, gens):
        for g in group:
            texts.append(model_text(tokenizer, g))
            answers.append(prompt.answer)
            rows.append(RowInfo(prompt.source, prompt.text, prompt.metadata, prompt.index))
            lengths.append(len(g.token_ids))
    outcome = scorer.score(texts, answers, rows)
    n = len(gens[0]) if gens else 1
    kept = [{"index": prompt.index, "source": prompt.source, "prompt": prompt.text,
                "response": texts[i * n + j], "reward": outcome.rewards[i * n + j],
                "tokens": lengths[i * n + j], "finish": g.finish_reason,
                **({"turns": g.turns, "tool_calls": g.tool_calls, "tool_errors": g.tool_errors}
                   if tools else {})}
               for i, (prompt, group) in enumerate(zip(prompts, gens)) for j, g in enumerate(group)]
    per_prompt = [outcome.rewards[i * n:(i + 1) * n] for i in range(len(prompts))]
    flat = [g for group in gens for g in group]
    calls = sum(g.tool_calls for g in flat)
    tool_use = {"turns": sum(g.turns for g in flat) / len(flat),
                "tool_calls": calls / len(flat),
                "tool_error_frac": sum(g.tool_errors for g in flat) / max(calls, 1)} \
        if tools and flat else {}
    result = replace(_result(per_prompt, lengths, n, ks, outcome.num_timeouts),
                     num_errors=outcome.num_errors, failed_by_source=outcome.failed_by_source,
                     failure_examples=outcome.errors, tool_use=tool_use, responses=kept)
    sources = sorted({p.source for p in prompts})
    if len(sources) > 1:
        by = {}
        for s in sources:
            idx = [i for i, p in enumerate(prompts) if p.source == s]
            by[s] = _result([per_prompt[i] for i in idx],
                            [lengths[i * n + j] for i in idx for j in range(n)], n, ks, 0)
        result = replace(result, by_source=by)
    return result


def eval_record(results: dict[str, EvalResult], label: str, seconds: float) -> dict:
    """An evaluation's 'eval' record: each set's numbers, and the first set's under the keys of
    runs before named sets."""
    first = next(iter(results.values()))
    return {"label": label, "seconds": seconds,
            "sets": {name: r.as_dict() for name, r in results.items()},
            "eval_mean_at_k": first.mean_reward, "eval_pass_at_k": first.pass_at[max(first.pass_at)],
            "eval_k": first.samples, "eval_prompts": first.num_prompts}


def write_samples(directory: Path, results: dict[str, EvalResult]) -> None:
    """Each set's responses as JSON lines, ``directory/<set>.jsonl`` (``logging.eval_samples``),
    each file written whole or not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        outputs.write_file(directory / f"{name}.jsonl",
                           "".join(json.dumps(response) + "\n" for response in r.responses))


def _result(per_prompt: list[list[float]], lengths: list[int], n: int, ks: Sequence[int],
            timeouts: int) -> EvalResult:
    correct = [sum(r >= CORRECT for r in rs) for rs in per_prompt]
    total = max(len(per_prompt) * n, 1)
    return EvalResult(
        num_prompts=len(per_prompt), samples=n,
        mean_reward=sum(sum(rs) for rs in per_prompt) / total,
        pass_at={k: sum(pass_at_k(n, c, k) for c in correct) / max(len(correct), 1) for k in ks},
        mean_response_tokens=sum(lengths) / max(len(lengths), 1), num_timeouts=timeouts)


def evaluate(engine: RolloutEngine, scorer: RewardScorer, tokenizer, prompts: Sequence[Prompt],
             spec: SamplingSpec, ks: Sequence[int]) -> EvalResult:
    """``spec.n`` responses per prompt from one engine, scored with the training reward."""
    extra = {"rows": lambda k: tool_rows(prompts[k])} if engine.takes_rows else {}
    return score_eval(engine.generate([p.token_ids for p in prompts], spec, **extra), prompts,
                      scorer, tokenizer, ks, tools=engine.takes_rows)


def evaluate_checkpoint(cfg: Config, model: Path, *, data: list[str] | None, limit: int | None,
                        samples: int | None, output: str | None = None,
                        overwrite: bool = False) -> dict:
    """The ``eval`` command: every held-out set of ``data`` (``NAME=PATH`` or ``PATH`` each;
    default ``data.eval_path``'s sets; at most ``limit`` problems a set, default
    ``data.eval_size``), sampled as ``eval.*`` says (``samples`` overriding ``eval.samples``),
    from the checkpoint ``model`` (an HF directory, or a Megatron checkpoint of ours, converted
    to HF in a temporary directory first: a directory either way, which the caller checked),
    scored with ``cfg.reward``; the results by set as a dict, also written to ``output`` as
    JSON."""
    if output:
        outputs.check_destination(output, [model], overwrite=overwrite, what="--output",
                                  directory=False)
    cfg, notes = eval_config(cfg, data=data, limit=limit, samples=samples)
    for note in notes:
        print(f"[eval] {note}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = model
        if (model / "state.json").is_file() or (model / ".metadata").is_file():
            # a Megatron checkpoint (complete or not: loading names what is wrong): to HF first
            from mugrpo_megatron.learner.convert import megatron_to_hf

            hf = Path(tmp) / "hf"
            megatron_to_hf(model, hf, ParallelConfig(distributed_optimizer=False), cfg.model.dtype)
        from transformers import AutoTokenizer

        from mugrpo_megatron.data import load_eval_sets
        from mugrpo_megatron.engines import make_engine

        tokenizer = AutoTokenizer.from_pretrained(hf, trust_remote_code=cfg.model.trust_remote_code)
        sets = load_eval_sets(cfg.data, tokenizer)
        for name, (_, report) in sets.items():
            print(f"[eval] {name}: {report.summary()}")
        engine = make_engine(cfg.rollout, hf, dtype=cfg.model.dtype,
                             max_model_len=cfg.engine_max_len,
                             trust_remote_code=cfg.model.trust_remote_code)
        tools = ToolSetup.of(cfg, tokenizer)
        if tools is not None:  # held-out sets with the tools the policy trains with
            engine = tools.wrap(engine, cfg.rollout, leader=True)
        results = {}
        try:
            with RewardScorer(cfg.reward) as scorer:
                for name, (prompts, _) in sets.items():
                    spec = set_sampling(cfg, name)
                    result = evaluate(engine, scorer, tokenizer, prompts, spec,
                                      reported_k(cfg, spec.n))
                    print(f"[eval] {name}: {result.summary()}", flush=True)
                    if result.num_failed:
                        print(f"[eval] {name}: reward: {result.describe_failures()}",
                              file=sys.stderr, flush=True)
                    results[name] = result.as_dict()
        finally:
            engine.shutdown()
    out = {"model": str(model), "data": cfg.data.eval_sets, "sets": results}
    if output:
        outputs.write_file(output, json.dumps(out, indent=1))
    return out


def eval_config(cfg: Config, *, data: list[str] | None, limit: int | None,
                samples: int | None) -> tuple[Config, list[str]]:
    """The config the ``eval`` command scores with: ``--data``'s sets (``NAME=PATH`` or
    ``PATH``) in place of ``data.eval_path``'s, ``--limit`` problems a set, ``--samples``
    responses a prompt (sets named in ``eval.samples_by_set`` keep theirs), and of
    ``eval.pass_k`` the k that some set's samples reach (the others dropped, and said in the
    notes returned)."""
    data_cfg = cfg.data
    if data:
        data_cfg = replace(data_cfg, eval_path=dict(_named(item) for item in data))
    if limit is not None:
        data_cfg = replace(data_cfg, eval_size=limit)
    if not data_cfg.eval_sets:
        raise ValueError("eval needs held-out data: --data PATH (or NAME=PATH), or "
                         "data.eval_path in the config")
    notes = []
    eval_cfg = cfg.eval
    if data:  # eval.samples_by_set of the config's sets applies to a --data set of that name
        eval_cfg = replace(eval_cfg, samples_by_set={k: v for k, v in
                                                     eval_cfg.samples_by_set.items()
                                                     if k in data_cfg.eval_sets})
    if samples is not None:
        eval_cfg = replace(eval_cfg, samples=samples)
        most = max(eval_cfg.samples_for(name) for name in data_cfg.eval_sets)
        dropped = [k for k in eval_cfg.pass_k if k > most]
        if dropped:
            eval_cfg = replace(eval_cfg, pass_k=tuple(k for k in eval_cfg.pass_k if k <= most))
            notes.append(f"eval.pass_k: {', '.join(map(str, dropped))} dropped: more than the "
                         f"{most} response(s) a prompt that --samples {samples} gives; reporting "
                         + (f"pass@{', pass@'.join(map(str, eval_cfg.pass_k))}" if eval_cfg.pass_k
                            else f"pass@1 and pass@{most}"))
    return replace(cfg, data=data_cfg, eval=eval_cfg), notes  # checked again as a whole


def _named(item: str) -> tuple[str, str]:
    """``NAME=PATH`` as (NAME, PATH); a bare path is named by its stem."""
    from mugrpo_megatron.config.run import source_name

    name, sep, path = item.partition("=")
    if sep and name and "/" not in name and path:
        return name, path
    return source_name(item), item

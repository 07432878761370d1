"""The scorer: reward functions (``registry``) run in a killable process pool, each response
routed to its source's function (``reward.by_source``, else ``reward.name``) with what of its row
the function takes (``RewardSpec``: the prompt as rendered, the source, the metadata).

Each response is scored under a hard wall-clock limit: pebble's ``ProcessPool`` kills a worker that
overruns and starts a fresh one, so an adversarial completion costs at most ``timeout_s`` and scores
0. Responses travel to the workers ``reward.batch_responses`` at a time (one task per response
costs ~0.5 ms of pool overhead, more than a cheap reward: 10^6 responses a phase would spend
minutes on it); a batch that overruns ``timeout_s`` or loses its worker is scored again one
response per task, so the limit still holds per response, at twice ``timeout_s`` for a batch
with a hanging response. We use pebble rather than ``concurrent.futures`` because the latter
cannot stop a running task.

A failure (the function raised, returned something other than a finite number within
``reward.max_abs_reward``, or ran past ``timeout_s``) scores 0 and is counted by the response's
source, the first few kept with their source, data row and error (``RewardOutcome``); with
``reward.on_error: raise`` a function's failure raises ``RewardFailed`` instead, naming the same.

No worker outlives the process that owns the pool, however that process ends: each asks the
kernel, as it starts, to be killed when its parent dies (``procs.die_with_parent``), so a
SIGKILL of ``train`` leaves no worker holding memory.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import numbers
import os
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from pebble import ProcessExpired, ProcessPool

from mugrpo_megatron.config import RewardConfig
from mugrpo_megatron.procs import die_with_parent
from mugrpo_megatron.rewards.code import CasesNotRun
from mugrpo_megatron.rewards.registry import RewardFn, RewardSpec, resolve_reward
from mugrpo_megatron.rewards.sandbox import SandboxSpec


@dataclass(frozen=True)
class RowInfo:
    """What a reward function may read of a response's prompt and row, besides the answer."""

    source: str = ""
    prompt: str = ""
    """The prompt as rendered (the text of the token ids the engine was given)."""
    metadata: str = ""
    """The row's ``data.metadata_fields`` as a JSON object ('' without any)."""
    row: int = -1
    """The prompt's row in its data file (0-based), to name it when its reward fails; never
    given to the function."""

    def where(self) -> str:
        """The row as failure messages name it: its source and data row."""
        return f"{self.source or '(no source)'} row {self.row}"


def reward_specs(cfg: RewardConfig) -> tuple[list[RewardSpec], dict[str, int]]:
    """``reward.name``'s spec first, then each distinct ``reward.by_source`` function's, and
    which of them each routed source uses: every function imported and its signature checked
    here, in the parent, so a bad one stops the run before it starts."""
    specs = [RewardSpec.of(cfg.name)]
    index = {cfg.name: 0}
    route = {}
    for source, name in cfg.by_source.items():
        if name not in index:
            index[name] = len(specs)
            specs.append(RewardSpec.of(name, key=f"reward.by_source.{source}"))
        route[source] = index[name]
    return specs, route


class RewardFailed(RuntimeError):
    """A reward function failed under ``reward.on_error: raise``; the message names the source,
    the data row, the function and the error."""


MAX_FAILURE_EXAMPLES = 5
"""Failures kept with their message, a batch and a phase (every one is counted)."""


@dataclass
class RewardOutcome:
    """Rewards of one batch, and what went wrong while scoring it."""

    rewards: list[float]
    """One reward per response, in order; 0.0 where scoring timed out or failed."""
    num_timeouts: int = 0
    """Responses whose scoring passed reward.timeout_s and was killed, or whose program's test
    cases were cut short by reward.sandbox_program_s (``code.CasesNotRun``: a case not run is
    no failed case)."""
    num_errors: int = 0
    """Responses whose reward function raised, or returned something other than a finite number
    within reward.max_abs_reward (a string, a bool, NaN, 1e308...)."""
    failed_by_source: dict[str, int] = field(default_factory=dict)
    """Failed responses (errors and timeouts) by their source ('' for a response without a row)."""
    failed: list[int] = field(default_factory=list)
    """The index of every failed response."""
    errors: list[str] = field(default_factory=list)
    """The first few failures: each response's source and data row (its index in the batch
    without a row) and the error."""

    @property
    def num_failed(self) -> int:
        return self.num_errors + self.num_timeouts


def describe_failures(failed: int, responses: int, by_source: dict[str, int],
                      examples: list[str]) -> str:
    """Reward failures in one line, for the console, the phase log and eval's output: how many
    of how many responses, by source, and the first few with their row and error."""
    sources = ", ".join(f"{s or '(no source)'} {n}" for s, n in sorted(by_source.items()) if n)
    return (f"{failed} of {responses} responses failed to score and scored 0"
            + (f" (by source: {sources})" if sources else "")
            + (f"; first: {'; '.join(examples)}" if examples else ""))


class RewardScorer:
    """Scores (completion, answer) pairs in worker processes with a per-response time limit."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.specs, self.route = reward_specs(cfg)  # fail now, in the parent, with a clear message
        self.settings = {"max_answer_chars": cfg.max_answer_chars, "code_score": cfg.code_score,
                         "sandbox": SandboxSpec.of(cfg)}
        """What a function may take of ``reward.*`` (``registry.SETTINGS``)."""
        # spawn: the parent may hold threads (torch, the engine) that make fork unsafe.
        self._pool = ProcessPool(max_workers=cfg.num_workers,
                                 context=multiprocessing.get_context("spawn"),
                                 initializer=die_with_parent, initargs=(os.getpid(),))
        # started now, by this thread: Linux sends the parent-death signal when the *thread*
        # that started a worker ends, and pebble starts its first workers in the thread of the
        # first task (its replacements in its own manager thread, which lives with the pool)
        self._pool.schedule(os.getpid)

    def score(self, completions: Sequence[str], answers: Sequence[str],
              rows: Sequence[RowInfo] | None = None,
              on_done: Callable[[int], None] | None = None) -> RewardOutcome:
        """Score and wait: ``submit(...).result()``."""
        return self.submit(completions, answers, rows).result(on_done)

    def submit(self, completions: Sequence[str], answers: Sequence[str],
               rows: Sequence[RowInfo] | None = None) -> PendingScores:
        """Queue the responses on the workers, ``reward.batch_responses`` a task, and return at
        once: the caller (an engine replica's leader) goes on generating while they are scored.
        ``rows``: each response's prompt, source and metadata (None: no row, as for a plain
        completion and answer), which routes it and is given to a function that takes it."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if rows is not None and len(rows) != len(answers):
            raise ValueError(f"{len(answers)} answers but {len(rows)} rows")
        items = [self._item(c, a, rows[i] if rows is not None else None)
                 for i, (c, a) in enumerate(zip(completions, answers))]
        rows = list(rows) if rows is not None else [None] * len(items)
        k = self.cfg.batch_responses
        return PendingScores(self, [(items[i:i + k], rows[i:i + k], self._schedule(items[i:i + k]))
                                    for i in range(0, len(items), k)])

    def _item(self, completion: str, answer: str, row: RowInfo | None) -> tuple:
        """One response as a worker scores it: its function and arguments, only what the
        function takes of its row travelling with it."""
        spec = self.route.get(row.source, 0) if row is not None else 0
        takes = self.specs[spec].takes
        extra = {}
        if row is not None:
            extra = {k: getattr(row, k) for k in ("prompt", "source", "metadata") if k in takes}
        elif "source" in takes:
            extra["source"] = ""
        return spec, completion, answer, extra

    def _schedule(self, items: list[tuple]):
        return self._pool.schedule(_score_batch, args=(self.specs, items, self.settings),
                                   timeout=self.cfg.scoring_timeout_s)

    def _checked(self, value: object) -> float:
        """A reward function's return value as a float; ValueError (a counted reward error) unless
        it is a real number (not a bool or a string) within +-reward.max_abs_reward."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"reward must be a number, got {type(value).__name__} "
                             f"{str(value)[:50]!r}")
        value = float(value)
        if not math.isfinite(value) or abs(value) > self.cfg.max_abs_reward:
            raise ValueError(f"reward is {value}, outside +-{self.cfg.max_abs_reward:g} "
                             f"(reward.max_abs_reward)")
        return value

    def _failed(self, out: RewardOutcome, i: int, row: RowInfo | None, spec: int,
                error: str | None, cut: str | None = None) -> None:
        """Count response ``i``'s failure (``error``; None: it timed out, or its cases were
        ``cut`` short) by its source and keep the first few; under ``reward.on_error: raise`` a
        function's error raises instead."""
        where = row.where() if row is not None else f"response {i}"
        out.failed.append(i)
        if error is None:
            out.num_timeouts += 1
            message = f"{where}: {cut}" if cut else (
                f"{where}: scoring took over {self.cfg.scoring_timeout_s:g} s (reward.timeout_s)")
        else:
            out.num_errors += 1
            message = f"{where}: {error[:200]}"
            if self.cfg.on_error == "raise":
                raise RewardFailed(
                    f"reward.on_error is 'raise' and the reward of {where} failed: {error[:500]} "
                    f"({self.specs[spec].path}). Fix the function or its data, or set "
                    f"reward.on_error: zero to score such responses 0 and go on")
        source = row.source if row is not None else ""
        out.failed_by_source[source] = out.failed_by_source.get(source, 0) + 1
        if len(out.errors) < MAX_FAILURE_EXAMPLES:
            out.errors.append(message)

    def close(self) -> None:
        from mugrpo_megatron.rewards.sandbox import remove_orphans

        self._pool.stop()
        self._pool.join()
        remove_orphans()  # what its workers' exit handlers did not run to remove

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingScores:
    """Rewards being computed; ``done()`` without waiting, ``result()`` waits."""

    def __init__(self, scorer: RewardScorer, batches: list):
        self._scorer = scorer
        self._batches = batches
        """(the batch's items, their rows, future of its per-response outcomes)."""

    def done(self) -> bool:
        return all(f.done() for _, _, f in self._batches)

    def result(self, on_done: Callable[[int], None] | None = None) -> RewardOutcome:
        """The batch's rewards and failures; ``RewardFailed`` at a function's first failure under
        ``reward.on_error: raise``."""
        scorer = self._scorer
        out = RewardOutcome(rewards=[])
        for items, rows, fut in self._batches:
            try:
                outcomes = fut.result()
            except (Exception, ProcessExpired):  # noqa: BLE001 - a timeout, or a dead worker
                # the batch ran past timeout_s or its worker died: score each response alone,
                # under its own limit, to find the one at fault and keep the others' rewards
                outcomes = [self._alone(scorer._schedule([item])) for item in items]
            for (ok, value), item, row in zip(outcomes, items, rows):
                i = len(out.rewards)
                out.rewards.append(0.0)
                error = str(value) if ok == "error" else None
                if ok == "ok":
                    try:
                        out.rewards[i] = scorer._checked(value)
                    except ValueError as e:  # not a finite number within range: scores 0
                        error = f"ValueError: {e}"
                if ok in ("timeout", "cut") or error is not None:
                    scorer._failed(out, i, row, item[0], error,
                                   cut=f"cases cut short: {value}" if ok == "cut" else None)
                if on_done is not None:
                    on_done(1)
        return out

    @staticmethod
    def _alone(fut) -> tuple[str, object]:
        try:
            return fut.result()[0]
        except FutureTimeout:
            return "timeout", None
        except (Exception, ProcessExpired) as e:  # noqa: BLE001 - the worker died
            return "error", f"{type(e).__name__}: {str(e)[:200]}"


_FN_CACHE: dict[str, RewardFn] = {}


def _score_batch(specs: list[RewardSpec], items: list[tuple], settings: dict
                 ) -> list[tuple[str, object]]:
    """Runs in a worker: ("ok", value) or ("error", "Type: message") per response, so one
    response's exception costs only its own reward."""
    out: list[tuple[str, object]] = []
    for spec, completion, answer, extra in items:
        try:
            out.append(("ok", _call(specs[spec], completion, answer, extra, settings)))
        except CasesNotRun as e:  # the machine's time, not the function's fault: a timeout
            out.append(("cut", str(e)))
        except Exception as e:  # noqa: BLE001 - reported per response
            out.append(("error", f"{type(e).__name__}: {str(e)[:200]}"))
    return out


def _call(spec: RewardSpec, completion: str, answer: str, extra: dict,
          settings: dict) -> float:
    """Runs in a worker: import the reward once per process, then call it with what it takes
    (the metadata decoded from its JSON)."""
    fn = _FN_CACHE.get(spec.path)
    if fn is None:
        fn = _FN_CACHE[spec.path] = resolve_reward(spec.path)
    kwargs = dict(extra)
    if "metadata" in kwargs:
        kwargs["metadata"] = json.loads(kwargs["metadata"]) if kwargs["metadata"] else {}
    kwargs.update({k: v for k, v in settings.items() if k in spec.takes})
    return fn(completion, answer, **kwargs)

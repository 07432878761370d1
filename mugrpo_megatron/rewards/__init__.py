"""Rewards: a registry of reward functions and a scorer that runs them in a killable process pool.

A reward function is ``fn(completion: str, answer: str) -> float``, defined at module level (it
runs in worker processes). Register one with ``@register_reward("name")`` or name it in the config
by dotted path, ``reward.name: mypkg.rewards:exact_match``.

Each response is scored under a hard wall-clock limit: pebble's ``ProcessPool`` kills a worker that
overruns and starts a fresh one, so an adversarial completion costs at most ``timeout_s`` and scores
0. We use pebble rather than ``concurrent.futures`` because the latter cannot stop a running task.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from pebble import ProcessExpired, ProcessPool

from mugrpo_megatron.config import RewardConfig

RewardFn = Callable[[str, str], float]

# name -> "module:function"; stored as a path so workers import the function themselves.
_REGISTRY: dict[str, str] = {"math": "mugrpo_megatron.rewards.math_answer:math_reward"}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register a module-level reward function under ``name``."""

    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = f"{fn.__module__}:{fn.__qualname__}"
        return fn

    return wrap


def registered_rewards() -> dict[str, str]:
    return dict(_REGISTRY)


def resolve_reward(name: str) -> RewardFn:
    """The function for a registered name or a ``module:function`` (or ``module.function``) path."""
    path = _REGISTRY.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward.name: {name!r} is neither a registered reward "
                         f"({', '.join(sorted(_REGISTRY))}) nor a 'module:function' path")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.name: cannot import {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward.name: {path!r} is not callable")
    return fn


@dataclass
class RewardOutcome:
    """Rewards of one batch, and what went wrong while scoring it."""

    rewards: list[float]
    """One reward per response, in order; 0.0 where scoring timed out or failed."""
    num_timeouts: int = 0
    """Responses whose scoring passed reward.timeout_s and was killed."""
    num_errors: int = 0
    """Responses whose reward function raised, or returned something other than a finite number
    within reward.max_abs_reward (a string, a bool, NaN, 1e308...)."""
    errors: list[str] = field(default_factory=list)
    """The first few error messages, with the response index."""


class RewardScorer:
    """Scores (completion, answer) pairs in worker processes with a per-response time limit."""

    max_error_messages = 5

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        resolve_reward(cfg.name)  # fail now, in the parent, with a clear message
        self._fn = _call_by_path
        self._path = _REGISTRY.get(cfg.name, cfg.name)
        # spawn: the parent may hold threads (torch, the engine) that make fork unsafe.
        self._pool = ProcessPool(max_workers=cfg.num_workers,
                                 context=multiprocessing.get_context("spawn"))

    def score(self, completions: Sequence[str], answers: Sequence[str],
              on_done: Callable[[int], None] | None = None) -> RewardOutcome:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        futures = [self._pool.schedule(self._fn, args=(self._path, c, a, self.cfg.max_answer_chars),
                                       timeout=self.cfg.timeout_s)
                   for c, a in zip(completions, answers)]
        out = RewardOutcome(rewards=[0.0] * len(futures))
        for i, fut in enumerate(futures):
            try:
                out.rewards[i] = self._checked(fut.result())
            except FutureTimeout:
                out.num_timeouts += 1
                self._note(out, f"response {i}: scoring took over {self.cfg.timeout_s} s, scored 0")
            except (Exception, ProcessExpired) as e:  # noqa: BLE001 - any failure of user code scores 0
                out.num_errors += 1
                self._note(out, f"response {i}: {type(e).__name__}: {str(e)[:200]}")
            if on_done is not None:
                on_done(1)
        return out

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

    def _note(self, out: RewardOutcome, message: str) -> None:
        if len(out.errors) < self.max_error_messages:
            out.errors.append(message)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FN_CACHE: dict[str, RewardFn] = {}


def _call_by_path(path: str, completion: str, answer: str, max_answer_chars: int) -> float:
    """Runs in a worker: import the reward once per process, then call it."""
    fn = _FN_CACHE.get(path)
    if fn is None:
        fn = _FN_CACHE[path] = resolve_reward(path)
    if getattr(fn, "takes_max_answer_chars", False):
        return fn(completion, answer, max_answer_chars=max_answer_chars)  # type: ignore[call-arg]
    return fn(completion, answer)

"""The reward functions by name: a registry, and resolution of a dotted path.

A reward function is ``fn(completion: str, answer: str) -> float``, defined at module level (it
runs in worker processes). Register one with ``@register_reward("name")`` or name it in the config
by dotted path, ``reward.name: mypkg.rewards:exact_match``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

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


def reward_path(name: str) -> str:
    """The ``module:function`` path of a registered name (a path stays itself): what a worker
    process imports."""
    return _REGISTRY.get(name, name)


def resolve_reward(name: str) -> RewardFn:
    """The function for a registered name or a ``module:function`` (or ``module.function``) path."""
    path = reward_path(name)
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

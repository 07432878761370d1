"""The reward functions by name: a registry, resolution of a dotted path, and what a function
takes besides the completion and the answer.

A reward function is ``fn(completion: str, answer: str, *, prompt=..., source=..., metadata=...)
-> float``, defined at module level (it runs in worker processes); the keyword parameters are
optional, each given only to a function that names it (``RewardSpec``, read from the signature
once): ``prompt`` the prompt as rendered (the text of its token ids), ``source`` the prompt's
source, ``metadata`` a dict of its row's ``data.metadata_fields``. Register one with
``@register_reward("name")`` or name it in the config by dotted path, ``reward.name:
mypkg.rewards:exact_match``. A function may also take, by name, the settings of ``SETTINGS``
(``sandbox``: run programs as the code reward does).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

RewardFn = Callable[..., float]
ROW_PARAMETERS = ("prompt", "source", "metadata")
"""What a reward function may take besides ``(completion, answer)``, by name."""

# name -> "module:function"; stored as a path so workers import the function themselves.
_REGISTRY: dict[str, str] = {"math": "mugrpo_megatron.rewards.math_answer:math_reward",
                             "math_dapo": "mugrpo_megatron.rewards.math_answer:dapo_math_reward",
                             "code": "mugrpo_megatron.rewards.code:code_reward"}
SETTINGS = ("max_answer_chars", "sandbox", "code_score")
"""What else a function may take by name, from ``reward.*``: the math rewards' answer cap, the
sandbox programs run in (``rewards.sandbox.SandboxSpec``: a function that takes it runs code,
and the run checks the sandbox before it starts) and the code reward's scoring."""


@dataclass(frozen=True)
class RewardSpec:
    """A reward function as the scorer calls it: its import path and which of
    ``ROW_PARAMETERS`` it takes (its signature, read once in the parent)."""

    path: str
    takes: frozenset[str]

    @classmethod
    def of(cls, name: str, key: str = "reward.name") -> RewardSpec:
        """The spec of a registered name or path; ValueError, naming ``key``, for a function
        that cannot be imported or has a parameter the scorer cannot give."""
        fn = resolve_reward(name, key)
        return cls(reward_path(name), reward_parameters(fn, key, name))


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


def resolve_reward(name: str, key: str = "reward.name") -> RewardFn:
    """The function for a registered name or a ``module:function`` (or ``module.function``) path;
    errors name the setting ``key``."""
    path = reward_path(name)
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{key}: {name!r} is neither a registered reward "
                         f"({', '.join(sorted(_REGISTRY))}) nor a 'module:function' path")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot import {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is not callable")
    return fn


def reward_parameters(fn: RewardFn, key: str, name: str) -> frozenset[str]:
    """Which of ``ROW_PARAMETERS`` ``fn`` takes: those it names (or all, with ``**kwargs``).
    ValueError, naming ``key``, unless it takes the completion and the answer as its first two
    positional parameters and has no other required one."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called with two
        return frozenset()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not star:
        raise ValueError(f"{key}: {name!r} must take (completion, answer) as its first two "
                         f"parameters; its signature is {inspect.signature(fn)}")
    takeable = (*ROW_PARAMETERS, *SETTINGS)
    named = positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
    for p in named:
        if p.name not in takeable and p.default is p.empty:
            raise ValueError(f"{key}: {name!r} has a required parameter {p.name!r} that the "
                             f"scorer cannot give: it gives completion, answer and, by name, "
                             f"{', '.join(ROW_PARAMETERS)} (give {p.name!r} a default, or read "
                             f"it from metadata)")
    takes = {p.name for p in named} & set(takeable)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        takes.update(ROW_PARAMETERS)
    return frozenset(takes)

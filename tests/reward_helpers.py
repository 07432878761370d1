"""Module-level reward functions for the scorer tests (workers import them by path)."""

import os
import shutil
import time

import pytest

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (scripts/setup_env.sh does it)")
"""The code reward's OS sandbox tests need bubblewrap."""

SLOW_ENV = "MUGRPO_TEST_SLOW_REWARD"
"""Seconds the digit rewards sleep a response, set in the environment of a run a test kills
while it scores (``SLOW``); unset, they score at once (runs that are not killed mid-generation
need not wait: the rewards, and so every loss, are the same)."""
SLOW = {SLOW_ENV: "0.15"}


def sleepy_reward(completion: str, answer: str) -> float:
    if completion == "hang":
        time.sleep(3600)
    return 1.0 if completion == answer else 0.0


def heavy_modules_reward(completion: str, answer: str) -> float:
    """1.0 while the reward worker that runs it holds none of the modules named in
    ``completion`` (space-separated), else 0.0."""
    import sys

    return float(not any(name in sys.modules for name in completion.split()))


def broken_reward(completion: str, answer: str) -> float:
    if completion == "boom":
        raise RuntimeError("reward function failed")
    if completion == "nan":
        return float("nan")
    return 0.5


def slow_digits_reward(completion: str, answer: str) -> float:
    """A reward a random tiny model can earn (it emits digits now and then), slow enough, with
    ``SLOW`` in the run's environment, that a test can kill the run while it scores."""
    return _digits(completion)


def echo_reward(completion: str, answer: str):
    """Returns the Python value the completion spells, whatever its type (for range checks)."""
    import ast

    return float(completion) if completion.endswith("inf") else ast.literal_eval(completion)


def _digits(completion: str) -> float:
    time.sleep(float(os.environ.get(SLOW_ENV, 0)))  # a test kills the run while it scores
    return float(sum(ch.isdigit() for ch in completion) >= 2)


def row_reading_reward(completion: str, answer: str, *, prompt: str, metadata: dict) -> float:
    """Reads its row: the prompt as rendered (-1 unless the chat template's thinking-off marker
    is in it: data.chat_template_kwargs reached the template) and the row's metadata (its
    extra_info.scale scales the reward). Like a user's reward that needs a field some rows leave
    empty, it raises ``KeyError: None`` for rows whose extra_info.index is 1 modulo 4."""
    if "<think>\n\n</think>" not in prompt:
        return -1.0
    info = metadata["extra_info"]
    if info.get("index", 0) % 4 == 1:
        raise KeyError(info.get("unit"))
    return info["scale"] * _digits(completion)


def source_reward(completion: str, answer: str, *, source: str) -> float:
    """Takes the source by name: 0.25 a point on the source it is routed to, -1 elsewhere."""
    return 0.25 * _digits(completion) if source == "mixB" else -1.0


def needs_units(completion: str, answer: str, units: str) -> float:
    """A parameter the scorer cannot give (for the error it must raise)."""
    return 0.0


def fraction_averse_reward(completion: str, answer: str) -> float:
    """1 for a completion holding the answer; raises for answers written as a LaTeX fraction
    (a reward that cannot parse some of a benchmark's answers)."""
    if "\\frac" in answer:
        raise ValueError(f"cannot parse {answer!r}")
    return float(answer in completion)

"""Module-level reward functions for the scorer tests (workers import them by path)."""

import time


def sleepy_reward(completion: str, answer: str) -> float:
    if completion == "hang":
        time.sleep(3600)
    return 1.0 if completion == answer else 0.0


def broken_reward(completion: str, answer: str) -> float:
    if completion == "boom":
        raise RuntimeError("reward function failed")
    if completion == "nan":
        return float("nan")
    return 0.5


def slow_digits_reward(completion: str, answer: str) -> float:
    """A reward a random tiny model can earn (it emits digits now and then), slow enough that a
    test can kill a run while it scores."""
    time.sleep(0.15)
    return float(sum(ch.isdigit() for ch in completion) >= 2)


def echo_reward(completion: str, answer: str):
    """Returns the Python value the completion spells, whatever its type (for range checks)."""
    import ast

    return float(completion) if completion.endswith("inf") else ast.literal_eval(completion)

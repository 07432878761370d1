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

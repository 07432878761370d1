"""Tools for the trajectory tests, importable by tool workers as ``tool_helpers:NAME`` (the
tests directory is on their path)."""

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def lookup(key: str, create_kwargs: dict | None = None) -> str:
    """Look a key up in the row's table.

    Args:
        key: What to look up.
    """
    return str((create_kwargs or {}).get("table", {}).get(key, "missing"))


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def answered_42(completion: str, answer: str) -> float:
    """A reward for the tool-calling tiny policy: 1 where the model's text boxes 42."""
    return float("\\boxed{42}" in completion)


def python(code: str, create_kwargs: dict | None = None) -> str:
    """Answers with its row's tag instead of running anything: a stand-in under the name the
    tiny tool policy was taught to call, to see which row's settings reach a call.

    Args:
        code: The program (not run).
    """
    return f"tag={(create_kwargs or {}).get('tag')}"


def noisy(x: str) -> str:
    """Prints a lot, answers briefly.

    Args:
        x: Anything.
    """
    import sys

    for _ in range(100):
        print("NOISE from a tool")
        print("NOISE on stderr", file=sys.stderr)
    return f"quiet {x}"


def worker_pid() -> int:
    """The pid of the worker process that runs the call."""
    import os

    return os.getpid()

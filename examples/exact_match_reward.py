"""A reward plugged in by dotted path: exact match of the last line, for tasks whose answers are
short strings rather than math.

    python -m mugrpo_megatron train --config configs/demo_cpu.yaml \
        --set reward.name=examples.exact_match_reward:exact_last_line

The function runs in the scorer's worker processes under the reward time limit, so it must be a
module-level function of an importable module (run from the repository root for `examples.`).
"""


def exact_last_line(completion: str, answer: str) -> float:
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return 1.0 if lines and lines[-1] == answer.strip() else 0.0

"""Rewards for the "Bring your dataset" example (docs/bring_your_dataset.md): one that reads its
row's metadata and prompt, routed to one source; the math reward takes the rest.

A reward function takes (completion, answer) and, by name, any of ``prompt`` (the prompt as
rendered), ``source`` and ``metadata`` (a dict of ``data.metadata_fields``). It runs in the
scorer's worker processes under ``reward.timeout_s``, so it must be a module-level function of
an importable module (run from the repository root for ``examples.``)."""

from mugrpo_megatron.rewards.math_answer import math_reward


def math_with_units(completion: str, answer: str, *, prompt: str, metadata: dict) -> float:
    """The math reward, with half a point off an answer that does not name the unit the row's
    ``extra_info.unit`` asks for (the prompt asks for it too: only if the prompt does)."""
    score = math_reward(completion, answer)
    unit = metadata["extra_info"]["unit"]
    if score and unit in prompt and unit not in completion:
        return 0.5
    return score

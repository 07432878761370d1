"""Typed data passed between the parts of the system."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Prompt:
    """One training or evaluation prompt, tokenized once."""

    index: int
    """Row of the source dataset (0-based)."""
    text: str
    """The prompt as the dataset gave it (before the chat template)."""
    answer: str
    """The gold answer the reward checks against."""
    token_ids: tuple[int, ...]
    """The prompt after the chat template, as token ids."""


@dataclass
class LoadReport:
    """What loading a prompt dataset kept and what it left out."""

    source: str
    """The file, hub id or builtin task the rows came from."""
    num_rows: int = 0
    """Rows read."""
    num_kept: int = 0
    """Rows turned into prompts."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows skipped (data.on_bad_row: skip), by reason."""
    examples: list[str] = field(default_factory=list)
    """The first few skipped rows, with their row number and reason."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        text = f"{self.source}: {self.num_kept}/{self.num_rows} rows kept"
        if self.skipped:
            text += " (skipped: " + ", ".join(f"{n} {why}" for why, n in self.skipped.items()) + ")"
        return text


@dataclass
class TokenBatch:
    """Right-padded token sequences (prompt + response) and where the responses are.

    Every ``[B, S]`` tensor is aligned with ``tokens``: position t is about token t.
    """

    tokens: torch.Tensor
    """[B, S] int64 token ids, prompt then response, right-padded."""
    response_mask: torch.Tensor
    """[B, S] bool, True at the positions of response tokens."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class TrainBatch(TokenBatch):
    """A minibatch for one optimizer update."""

    behav_logp: torch.Tensor
    """[B, S] float: the behaviour policy's log-prob of each response token (0 elsewhere)."""
    advantages: torch.Tensor
    """[B] float: the response's group-normalised advantage."""

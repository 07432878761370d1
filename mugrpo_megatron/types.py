"""Typed data passed between the parts of the system."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: G responses per prompt."""

    n: int
    """Responses per prompt (G)."""
    max_new_tokens: int
    """Longest response."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    """Sampling seed (None: the engine's own stream). Engines that seed per request sample the
    j-th response to prompt i with seed + i * n + j, so no two samples of a call share a seed."""

    def seed_at(self, position: int) -> int | None:
        """The seed of the prompt at ``position`` of a call: its j-th response samples with this
        + j. The one formula every engine and caller uses, so that a prompt samples the same
        whichever replica serves it, in whichever call."""
        return None if self.seed is None else self.seed + position * self.n

    def from_position(self, position: int) -> SamplingSpec:
        """This spec for a call whose first prompt stands at ``position`` of this one."""
        return self if self.seed is None else replace(self, seed=self.seed_at(position))


@dataclass(frozen=True)
class Generation:
    """One sampled response: one model turn, or a trajectory of model turns and the tool
    messages between them (``rollout.tools``), its tokens exactly those the engine saw."""

    token_ids: tuple[int, ...]
    """The tokens after the prompt: generated ones, and in a trajectory the tool messages'."""
    logprobs: tuple[float, ...]
    """The behaviour policy's log-prob of each token as the engine sampled it (0.0 at a tool
    message's tokens, which no policy sampled)."""
    finish_reason: str
    """'stop' (EOS or a stop token, no tool call after it), 'length' (``max_new_tokens``, which
    counts every token after the prompt, reached) or 'turns' (``rollout.max_turns`` model turns,
    the last one calling a tool)."""
    tool_spans: tuple[int, ...] = ()
    """Where the tool messages are in ``token_ids``: [start, end) pairs, flattened. Those tokens
    take no part in the loss; a trajectory starts and ends with model tokens."""
    turns: int = 1
    """Model turns."""
    tool_calls: int = 0
    """Tool calls the model made (a malformed one counted as one)."""
    tool_errors: int = 0
    """Calls that came back as an error message: malformed, an unknown tool, bad arguments, a
    tool that raised or ran past its time."""

    @property
    def tool_tokens(self) -> int:
        return sum(self.tool_spans[1::2]) - sum(self.tool_spans[0::2])


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
    source: str = ""
    """Where the prompt comes from: its row's ``data.source_field`` (verl's ``data_source``), or
    the stem of its file; what ``reward.by_source`` routes on and metrics are split by."""
    metadata: str = ""
    """The row's ``data.metadata_fields`` as a JSON object ('' without any), for rewards that
    read them."""


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
    files: list[dict] = field(default_factory=list)
    """For a mixture: each file's source, rows and kept prompts, in ``data.path`` order."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def add(self, other: LoadReport) -> None:
        """Count ``other``'s file into this one (a mixture's report)."""
        self.num_rows += other.num_rows
        self.num_kept += other.num_kept
        for why, n in other.skipped.items():
            self.skipped[why] = self.skipped.get(why, 0) + n
        self.examples += other.examples[:max(0, 5 - len(self.examples))]
        self.files.append({"source": other.source, "num_rows": other.num_rows,
                           "num_kept": other.num_kept})

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
    ref_logp: torch.Tensor | None = None
    """[B, S] float: a reference policy's log-prob of each response token (0 elsewhere), for
    ``algo.kl_target: reference``; None without a KL term to a reference."""
    is_weight: torch.Tensor | None = None
    """[B, S] float: each response token's importance weight from the engine's sampling to the
    behaviour policy (``algo.rollout_is``: ``rollout_correction``; 1 elsewhere); None: 1."""


@dataclass(frozen=True)
class Shard:
    """The part of one HF tensor a weight sync sends an engine rank that keeps only that part
    (``learner.export.iter_hf_tensors(engine_tp=...)``): its values, the whole tensor's shape and
    where the values lie in it. The engine is handed what was sent, not the zeros around it: it
    does any per-slice work on the values first (block-FP8 quantization: 1/TP of the elements,
    not the whole tensor's), counts their bytes as what the sync moved, and only then builds
    the full-shape tensor vLLM's loaders narrow to the same slice (``whole``)."""

    values: torch.Tensor
    shape: tuple[int, ...]
    """The whole tensor's."""
    region: tuple[tuple[int, int], ...]
    """(start, stop) of ``values`` along each dimension of the whole."""

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def whole(self, fill: float = 0.0) -> torch.Tensor:
        """The full-shape tensor: ``values`` in their region, ``fill`` elsewhere."""
        import torch

        out = torch.full(self.shape, fill, dtype=self.values.dtype, device=self.values.device)
        out[tuple(slice(a, b) for a, b in self.region)] = self.values
        return out

    def with_values(self, values: torch.Tensor, block: tuple[int, ...] | None = None) -> Shard:
        """The same place with other values: the same region, or, with ``block``, the region
        of the blocks the region covers (a block-FP8 weight's scales), which must start on a
        block and end on one or at the whole's end (ValueError: a block that two ranks' slices
        would share)."""
        if block is None:
            return Shard(values, self.shape, self.region)
        shape, region = [], []
        for n, (a, b), k in zip(self.shape, self.region, block):
            if a % k or (b % k and b != n):
                raise ValueError(f"a slice [{a}, {b}) of a dimension of {n} is not whole blocks "
                                 f"of {k}: a block would hold two engine ranks' weights")
            shape.append(-(-n // k))
            region.append((a // k, -(-b // k)))
        return Shard(values, tuple(shape), tuple(region))

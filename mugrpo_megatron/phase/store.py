"""Each phase's rollouts on disk as Arrow IPC shards, and the per-rank view the learner trains on.

::

    rollouts/phase_0003/
        shard_000000512.arrow   whole groups, scored, written by one engine replica's leader as
                                they finished (named by the phase position of its first group)
        plan.json               the phase's plan (first update, prompts, the updates it is
                                sized for), written before it generates, checked on resume
        index.arrow             written once, when every group of the phase is on disk: each
                                response in phase order (group, then sample), the shard and row
                                it lives in, reward, overlong penalty, advantage, length, source,
                                and whether it was cut at the length limit and its group is
                                uniform. Its presence means the phase is generated.
        reference_logprobs.arrow with algo.kl_coef > 0 and kl_target: reference, the reference
                                policy's log-prob of every response token, in phase order
        behaviour_learner.arrow with algo.behaviour_logprobs: learner, the learner's log-prob of
                                every response token under the weights the engine sampled from,
                                in phase order (written before the phase's first update)

Why Arrow IPC (uncompressed): token ids and log-probs are list columns (int32 offsets and flat
values) at fixed places in the file, so a reader fetches one row's tokens with one ``pread`` and
gets a numpy array, with no decoding and no Python object per token; Parquet would decode whole
pages to read a row. Every file is written to a temporary name,
fsynced, and renamed: a reader sees a whole shard or none, so a kill loses only the groups not yet
written, and a resume (with any number of replicas) regenerates exactly those.

What grows with what, at 10^6 responses, 10^9 response tokens and ~300 prompt tokens:
shards hold 4 GB of response ids, 4 GB of log-probs and 1.2 GB of prompt ids (each of the G
responses repeats its prompt, so a shard reads alone) on the shared run directory, and the
source of each response (~10 B); index.arrow is ~50 B a response (50 MB). Each rank holds, per
response: the shards' list offsets (8 B), the index columns (~50 B, a read-only map of
index.arrow) and the train-row list (8 B): ~66 MB at 10^6 responses, against the ~10 GB of the
phase; plus one update's batch, and a file descriptor per shard. The page cache may hold more of
the shards; it is the kernel's, shared by the node's ranks. Reading a phase back is
``phase.data``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from mugrpo_megatron.arrow_files import AtomicFile, list_column
from mugrpo_megatron.objective import group_advantages, overlong_penalty
from mugrpo_megatron.outputs import write_file
from mugrpo_megatron.phase.schedule import Phase
from mugrpo_megatron.types import Generation

SHARD_SCHEMA = pa.schema([
    ("group", pa.int64()),             # position of the prompt in the phase
    ("sample", pa.int32()),            # j of the group's G responses
    ("prompt_index", pa.int64()),      # row of the prompt in the training set
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("behav_logprobs", pa.list_(pa.float32())),  # the engine's log-prob of each response token
    ("finish_reason", pa.string()),    # 'stop' or 'length'
    ("reward", pa.float64()),
    ("source", pa.string()),           # the prompt's source (data.source_field or its file)
    # trajectories (rollout.tools): where tool messages sit in response_ids, [start, end) pairs
    # flattened (empty without tools), the model turns, tool calls and calls that failed
    ("tool_spans", pa.list_(pa.int32())),
    ("turns", pa.int32()), ("tool_calls", pa.int32()), ("tool_errors", pa.int32()),
])
INDEX_SCHEMA = pa.schema([
    ("group", pa.int64()), ("shard", pa.int32()), ("row", pa.int32()), ("reward", pa.float64()),
    ("penalty", pa.float64()), ("advantage", pa.float64()), ("response_len", pa.int32()),
    ("truncated", pa.bool_()), ("uniform", pa.bool_()), ("source", pa.int32()),
    ("tool_tokens", pa.int32()), ("turns", pa.int32()), ("tool_calls", pa.int32()),
    ("tool_errors", pa.int32()),
])


@dataclass(frozen=True)
class Advantages:
    """How a phase's rewards become advantages, once, when it is indexed (``finalize``): DAPO's
    overlong penalty added to each reward, then group-normalised (``objective.group_advantages``,
    Dr.GRPO's without the std)."""

    eps: float = 1e-6
    """``algo.adv_eps``."""
    norm_by_std: bool = True
    """``algo.norm_adv_by_std``."""
    max_new_tokens: int = 0
    """``rollout.max_new_tokens``, where the overlong penalty reaches its full value."""
    overlong_buffer_tokens: int = 0
    """``algo.overlong_buffer_tokens`` (0: no penalty)."""
    overlong_penalty: float = 1.0
    """``algo.overlong_penalty``."""

    @classmethod
    def of(cls, cfg) -> Advantages:
        a = cfg.algo
        return cls(a.adv_eps, a.norm_adv_by_std, cfg.rollout.max_new_tokens,
                   a.overlong_buffer_tokens, a.overlong_penalty)

    def penalty(self, lengths: np.ndarray) -> np.ndarray:
        """Each response's overlong penalty (0 without one)."""
        return overlong_penalty(torch.from_numpy(np.asarray(lengths)), self.max_new_tokens,
                                self.overlong_buffer_tokens, self.overlong_penalty).numpy()

    def informative(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int
                    ) -> np.ndarray:
        """[groups] bool: whether each group's shaped rewards differ (its advantages are not
        all 0), from its rewards and lengths in phase order (``uniform_groups: refill``)."""
        shaped = (np.asarray(rewards, np.float64) + self.penalty(lengths)).reshape(-1, group_size)
        return shaped.max(axis=1) != shaped.min(axis=1)


@dataclass(frozen=True)
class ScoredGroup:
    """The G responses to one prompt of a phase, with their rewards: the unit a shard persists.
    Token ids and log-probs are numpy arrays (8 bytes a token), not the engine's tuples (~70)."""

    position: int
    """Position of the prompt in the phase (its seeds and its place in the index follow from it)."""
    prompt_index: int
    prompt_ids: Sequence[int]
    responses: Sequence[np.ndarray]
    """int32 token ids of each response."""
    logprobs: Sequence[np.ndarray]
    """float32 behaviour log-prob of each response token."""
    finish_reasons: Sequence[str]
    rewards: Sequence[float]
    source: str = ""
    """The prompt's source (``Prompt.source``)."""
    tool_spans: Sequence[Sequence[int]] = ()
    """Each response's ``Generation.tool_spans`` (empty: no tool message anywhere)."""
    turns: Sequence[int] = ()
    """Each response's model turns, tool calls and failed calls (empty: one turn, none)."""
    tool_calls: Sequence[int] = ()
    tool_errors: Sequence[int] = ()

    @classmethod
    def of(cls, position: int, prompt_index: int, prompt_ids: Sequence[int],
           generations: Sequence[Generation], rewards: Sequence[float], source: str = ""
           ) -> ScoredGroup:
        return cls(position, prompt_index, prompt_ids,
                   [np.asarray(g.token_ids, dtype=np.int32) for g in generations],
                   [np.asarray(g.logprobs, dtype=np.float32) for g in generations],
                   [g.finish_reason for g in generations], list(rewards), source,
                   [g.tool_spans for g in generations], [g.turns for g in generations],
                   [g.tool_calls for g in generations], [g.tool_errors for g in generations])

    def per_response(self, name: str, default: int) -> list:
        """A per-response trajectory field, ``default`` each where the group has none."""
        values = getattr(self, name)
        return list(values) if len(values) else [default] * len(self.responses)


def phase_dir(run_dir: Path, phase: int) -> Path:
    return run_dir / "rollouts" / f"phase_{phase:04d}"


def write_shard(directory: Path, groups: Sequence[ScoredGroup]) -> Path:
    """Persist whole groups atomically as one shard; returns its path. Memory: one shard."""
    if not groups:
        raise ValueError("a shard needs at least one group")
    for g in groups:
        if not len(g.responses) == len(g.logprobs) == len(g.finish_reasons) == len(g.rewards):
            raise ValueError(f"group {g.position}: responses, log-probs, finish reasons and "
                             f"rewards differ in number")
    directory.mkdir(parents=True, exist_ok=True)
    sizes = [len(g.responses) for g in groups]
    table = pa.table({
        "group": pa.array(np.repeat([g.position for g in groups], sizes), pa.int64()),
        "sample": pa.array(np.concatenate([np.arange(n) for n in sizes]), pa.int32()),
        "prompt_index": pa.array(np.repeat([g.prompt_index for g in groups], sizes), pa.int64()),
        "prompt_ids": list_column([g.prompt_ids for g in groups for _ in g.responses], np.int32,
                                   pa.int32()),
        "response_ids": list_column([x for g in groups for x in g.responses], np.int32,
                                     pa.int32()),
        "behav_logprobs": list_column([x for g in groups for x in g.logprobs], np.float32,
                                       pa.float32()),
        "finish_reason": pa.array([x for g in groups for x in g.finish_reasons], pa.string()),
        "reward": pa.array([x for g in groups for x in g.rewards], pa.float64()),
        "source": pa.array(np.repeat([g.source for g in groups], sizes).tolist(), pa.string()),
        "tool_spans": list_column([x for g in groups for x in g.per_response("tool_spans", ())],
                                   np.int32, pa.int32()),
        **{name: pa.array([x for g in groups for x in g.per_response(name, SINGLE_TURN[name])],
                          pa.int32()) for name in PER_RESPONSE},
    }, schema=SHARD_SCHEMA)
    first = min(g.position for g in groups)
    path = directory / f"shard_{first:09d}.arrow"
    if path.exists():
        raise FileExistsError(f"{path} exists: group {first} was persisted already (two writers "
                              f"on one phase?)")
    with AtomicFile(path, table.schema, "rollouts") as f:
        f.write(table)
    return path


def column(t: pa.Table, name: str) -> np.ndarray:
    """A column of a one-record-batch file as numpy (a view of the mapping where the type
    allows: bool columns are bit-packed in Arrow and get copied, one byte a row)."""
    return t.column(name).chunk(0).to_numpy(zero_copy_only=False)


def open_table(path: Path) -> pa.Table:
    """The file's table, memory-mapped (zero-copy column access)."""
    try:
        return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable rollout shard ({e}); it was not written by "
                         f"this version, or was damaged after it was written") from e


def shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("shard_*.arrow"))


def persisted_groups(directory: Path, num_groups: int) -> np.ndarray:
    """[num_groups] bool: which of the phase's first ``num_groups`` positions have their group
    on disk (reads one column per shard). ``num_groups`` bounds the positions a phase can hold
    (with ``uniform_groups: refill``, its planned groups and the rounds beyond them)."""
    done = np.zeros(num_groups, dtype=bool)
    for path in shard_paths(directory):
        groups = column(open_table(path), "group")
        if groups.size and (groups.min() < 0 or groups.max() >= num_groups):
            raise ValueError(f"{path}: holds group {int(groups.max())}, but the phase has at most "
                             f"{num_groups}; this run directory belongs to another setting")
        done[groups] = True
    return done


def informative_groups(directory: Path, num_groups: int, group_size: int,
                       advantages: Advantages) -> np.ndarray:
    """[num_groups] bool: the persisted groups whose shaped rewards differ (their advantages are
    not all 0), for a resumed refill: one reward and one offsets column per shard."""
    out = np.zeros(num_groups, dtype=bool)
    for path in shard_paths(directory):
        t = open_table(path)
        order = np.lexsort((column(t, "sample"), column(t, "group")))
        groups = column(t, "group")[order][::group_size]
        lengths = np.diff(t.column("response_ids").chunk(0).offsets.to_numpy())[order]
        out[groups] = advantages.informative(column(t, "reward")[order], lengths, group_size)
    return out


SINGLE_TURN = {"tool_tokens": 0, "turns": 1, "tool_calls": 0, "tool_errors": 0}
"""A response sampled without tools as the trajectory columns hold it, and what a shard or an
index written before they were kept stands for."""
TRAJECTORY_COUNTS = tuple(SINGLE_TURN)
"""What the index keeps of each response's trajectory (``rollout.tools``)."""
PER_RESPONSE = TRAJECTORY_COUNTS[1:]
"""Those a shard keeps as they came (the tool tokens are summed from the spans)."""


def trajectory_counts(t: pa.Table) -> dict[str, np.ndarray]:
    """A shard's ``TRAJECTORY_COUNTS``, one int32 a response: its tool tokens (summed from the
    spans, vectorised), turns, calls and failed calls; a shard written before trajectories
    were kept holds single turns."""
    n = t.num_rows
    if "tool_spans" not in t.column_names:
        return {name: np.full(n, value, np.int32) for name, value in SINGLE_TURN.items()}
    spans = t.column("tool_spans").chunk(0)
    values = spans.values.to_numpy().astype(np.int64)
    signed = np.where(np.arange(len(values)) % 2 == 1, values, -values)  # end - start a span
    offsets = spans.offsets.to_numpy()
    running = np.concatenate([[0], np.cumsum(signed)])
    tool_tokens = (running[offsets[1:]] - running[offsets[:-1]]).astype(np.int32)
    return {"tool_tokens": tool_tokens, **{name: column(t, name).astype(np.int32)
                                           for name in PER_RESPONSE}}


def is_generated(directory: Path) -> bool:
    return (directory / "index.arrow").exists()


PLAN_FILE = "plan.json"


def record_plan(directory: Path, phase: Phase) -> None:
    """Rank 0, before a phase generates: keep its plan beside its rollouts (``plan.json``: where
    it starts, its prompts, the updates it is sized for), or, when a start before this one wrote
    it, check that this start planned the same phase: ValueError otherwise, since the shards on
    disk were sampled for that plan."""
    path, plan = directory / PLAN_FILE, phase.plan_record()
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != plan:
            raise ValueError(f"{directory}: this phase was planned as {saved} by an earlier start "
                             f"of the run, and this start plans {plan}; its rollouts belong to "
                             f"the first plan. Nothing was changed.")
        return
    directory.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(plan))


def finalize(directory: Path, num_groups: int, group_size: int, advantages: Advantages
             ) -> Path:
    """Index the phase's shards in phase order (group position, then sample) with advantages
    computed once, vectorised (``Advantages``: the overlong penalty added to each reward, then
    group-normalised), uniform-group flags and sources; write ``index.arrow`` atomically.
    Checks that each of the phase's ``num_groups`` planned groups is there, that every group on
    disk (refill's beyond them too) has its G responses, and that none is there twice. Reads
    six small columns of each shard: O(responses) memory (~50 MB at 10^6), on one rank, once a
    phase."""
    paths = shard_paths(directory)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in (
        "group", "sample", "shard", "row", "reward", "length", "truncated", "source",
        *TRAJECTORY_COUNTS)}
    sources: dict[str, int] = {}
    for s, path in enumerate(paths):
        t = open_table(path)
        n = t.num_rows
        parts["group"].append(column(t, "group"))
        parts["sample"].append(column(t, "sample"))
        parts["shard"].append(np.full(n, s, dtype=np.int32))
        parts["row"].append(np.arange(n, dtype=np.int32))
        parts["reward"].append(column(t, "reward"))
        parts["length"].append(np.diff(t.column("response_ids").chunk(0).offsets.to_numpy()))
        parts["truncated"].append(column(t, "finish_reason") == "length")
        names = column(t, "source") if "source" in t.column_names else np.full(n, "")
        uniq, inverse = np.unique(names.astype(str), return_inverse=True)
        codes = np.array([sources.setdefault(str(u), len(sources)) for u in uniq], np.int32)
        parts["source"].append(codes[inverse].astype(np.int32))
        for name, values in trajectory_counts(t).items():
            parts[name].append(values)
    cols = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in parts.items()}
    order = np.lexsort((cols["sample"], cols["group"]))
    cols = {k: v[order] for k, v in cols.items()}
    group, sample = cols["group"].astype(np.int64), cols["sample"].astype(np.int64)
    key = group * group_size + sample
    bad = (sample < 0) | (sample >= group_size) | (group < 0)
    twice = np.flatnonzero(np.diff(key) == 0)
    if bad.any() or twice.size:
        at = cols["shard"][np.flatnonzero(bad)[0]] if bad.any() else \
            max(cols["shard"][twice[0]], cols["shard"][twice[0] + 1])
        raise ValueError(f"{paths[int(at)]}: holds responses outside the phase's groups of "
                         f"{group_size}, or ones another shard holds too")
    present, counts = np.unique(group, return_counts=True)
    missing = np.setdiff1d(np.arange(num_groups), present)
    if missing.size:
        raise ValueError(f"{directory}: {missing.size * group_size} of {num_groups * group_size} "
                         f"responses are missing (first: group {int(missing[0])}); the phase did "
                         f"not finish generating")
    if (counts != group_size).any():
        k = int(np.flatnonzero(counts != group_size)[0])
        raise ValueError(f"{directory}: group {int(present[k])} holds {int(counts[k])} of its "
                         f"{group_size} responses")
    penalty = advantages.penalty(cols["length"])
    shaped = torch.from_numpy(cols["reward"].astype(np.float64) + penalty)
    adv = group_advantages(shaped, group_size, advantages.eps, advantages.norm_by_std).numpy()
    by_group = shaped.numpy().reshape(-1, group_size)
    uniform = np.repeat(by_group.max(axis=1) == by_group.min(axis=1), group_size)
    table = pa.table({"group": group, "shard": cols["shard"].astype(np.int32),
                      "row": cols["row"].astype(np.int32),
                      "reward": cols["reward"].astype(np.float64), "penalty": penalty,
                      "advantage": adv, "response_len": cols["length"].astype(np.int32),
                      "truncated": cols["truncated"].astype(bool), "uniform": uniform,
                      "source": cols["source"].astype(np.int32),
                      **{name: cols[name].astype(np.int32) for name in TRAJECTORY_COUNTS}},
                     schema=INDEX_SCHEMA.with_metadata(
                         {"shards": json.dumps([p.name for p in paths]),
                          "group_size": str(group_size), "planned_groups": str(num_groups),
                          "sources": json.dumps(list(sources))}))
    path = directory / "index.arrow"
    with AtomicFile(path, table.schema, "rollouts") as f:
        f.write(table)
    return path

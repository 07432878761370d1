"""Each phase's rollouts on disk as Arrow IPC shards, and the per-rank view the learner trains on.

::

    rollouts/phase_0003/
        shard_000000512.arrow   whole groups, scored, written by one engine replica's leader as
                                they finished (named by the phase position of its first group)
        plan.json               the phase's plan (first update, prompts, the updates it is
                                sized for), written before it generates, checked on resume
        index.arrow             written once, when every group of the phase is on disk: each
                                response in phase order (group, then sample), the shard and row
                                it lives in, reward, advantage, length, and whether its group is
                                uniform. Its presence means the phase is generated.
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
responses repeats its prompt, so a shard reads alone) on the shared run directory; index.arrow is
~30 B a response (30 MB). Each rank holds, per response: the shards' list offsets (8 B), the
index columns (29 B, a read-only map of index.arrow) and the train-row list (8 B): ~45 MB at 10^6
responses, against the ~10 GB of the phase; plus one update's batch, and a file descriptor per
shard. The page cache may hold more of the shards; it is the kernel's, shared by the node's ranks.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from mugrpo_megatron.arrow_files import AtomicFile, buffer_positions, list_column
from mugrpo_megatron.objective import group_advantages
from mugrpo_megatron.outputs import write_file
from mugrpo_megatron.phase.batches import padded_batch
from mugrpo_megatron.phase.schedule import Minibatch, Phase, PhaseScheduler
from mugrpo_megatron.types import Generation, TrainBatch

SHARD_SCHEMA = pa.schema([
    ("group", pa.int64()),             # position of the prompt in the phase
    ("sample", pa.int32()),            # j of the group's G responses
    ("prompt_index", pa.int64()),      # row of the prompt in the training set
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("behav_logprobs", pa.list_(pa.float32())),  # the engine's log-prob of each response token
    ("finish_reason", pa.string()),    # 'stop' or 'length'
    ("reward", pa.float64()),
])
INDEX_SCHEMA = pa.schema([
    ("shard", pa.int32()), ("row", pa.int32()), ("reward", pa.float64()),
    ("advantage", pa.float64()), ("response_len", pa.int32()), ("truncated", pa.bool_()),
    ("uniform", pa.bool_()),
])


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

    @classmethod
    def of(cls, position: int, prompt_index: int, prompt_ids: Sequence[int],
           generations: Sequence[Generation], rewards: Sequence[float]) -> ScoredGroup:
        return cls(position, prompt_index, prompt_ids,
                   [np.asarray(g.token_ids, dtype=np.int32) for g in generations],
                   [np.asarray(g.logprobs, dtype=np.float32) for g in generations],
                   [g.finish_reason for g in generations], list(rewards))


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
    """[num_groups] bool: which of the phase's groups are on disk (reads one column per shard)."""
    done = np.zeros(num_groups, dtype=bool)
    for path in shard_paths(directory):
        groups = column(open_table(path), "group")
        if groups.size and (groups.min() < 0 or groups.max() >= num_groups):
            raise ValueError(f"{path}: holds group {int(groups.max())}, but the phase has "
                             f"{num_groups}; this run directory belongs to another setting")
        done[groups] = True
    return done


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


def finalize(directory: Path, num_groups: int, group_size: int, eps: float) -> Path:
    """Index the phase's shards in phase order with group-normalised advantages (computed once,
    vectorised) and uniform-group flags; write ``index.arrow`` atomically. Checks that every
    group is there exactly once, with its G responses. Reads four small columns of each shard:
    O(responses) memory (~40 MB at 10^6), on one rank, once a phase."""
    paths = shard_paths(directory)
    n = num_groups * group_size
    where = np.full(n, -1, dtype=np.int64)
    shard = np.zeros(n, dtype=np.int32)
    row = np.zeros(n, dtype=np.int32)
    reward = np.zeros(n, dtype=np.float64)
    length = np.zeros(n, dtype=np.int32)
    truncated = np.zeros(n, dtype=bool)
    for s, path in enumerate(paths):
        t = open_table(path)
        pos = column(t, "group") * group_size + column(t, "sample")
        if (pos < 0).any() or (pos >= n).any() or (where[pos] >= 0).any() or \
                len(np.unique(pos)) != len(pos):
            raise ValueError(f"{path}: holds responses outside the phase's {num_groups} x "
                             f"{group_size}, or ones another shard holds too")
        where[pos] = s
        shard[pos] = s
        row[pos] = np.arange(len(pos), dtype=np.int32)
        reward[pos] = column(t, "reward")
        offsets = t.column("response_ids").chunk(0).offsets.to_numpy()
        length[pos] = np.diff(offsets)
        truncated[pos] = column(t, "finish_reason") == "length"
    missing = np.flatnonzero(where < 0)
    if missing.size:
        raise ValueError(f"{directory}: {missing.size} of {n} responses are missing (first: group "
                         f"{missing[0] // group_size}); the phase did not finish generating")
    adv = group_advantages(torch.from_numpy(reward), group_size, eps).numpy()
    groups = reward.reshape(-1, group_size)
    uniform = np.repeat(groups.max(axis=1) == groups.min(axis=1), group_size)
    table = pa.table({"shard": shard, "row": row, "reward": reward, "advantage": adv,
                      "response_len": length, "truncated": truncated, "uniform": uniform},
                     schema=INDEX_SCHEMA.with_metadata(
                         {"shards": json.dumps([p.name for p in paths]),
                          "group_size": str(group_size)}))
    path = directory / "index.arrow"
    with AtomicFile(path, table.schema, "rollouts") as f:
        f.write(table)
    return path


def _locate(t: pa.Table, name: str, at) -> tuple[np.ndarray, int]:
    """A list column's offsets (copied) and the file position of its first value (4-byte values,
    as SHARD_SCHEMA has them; ``at`` from ``buffer_positions``)."""
    values = t.column(name).chunk(0).values
    return t.column(name).chunk(0).offsets.to_numpy().copy(), \
        at(values.buffers()[1]) + values.offset * 4


class _Shard:
    """One shard, read row by row with ``pread``: its list offsets in memory (8 bytes a row), its
    token and log-prob values on disk. Reads go through the page cache (shared by a node's ranks)
    without mapping the file into the rank, so a rank's memory does not grow as its updates read
    their way through the phase. (A memory map would: each page fault maps the pages around it,
    ~200 MB of a shard per 1024-row update, released only when unmapped.)"""

    def __init__(self, path: Path):
        try:
            with buffer_positions(path) as (reader, at):
                t = reader.read_all()
                self.prompt_off, self.prompt_at = _locate(t, "prompt_ids", at)
                self.resp_off, self.resp_at = _locate(t, "response_ids", at)
                _, self.logp_at = _locate(t, "behav_logprobs", at)  # response_ids' offsets
                del t
        except (pa.ArrowInvalid, OSError, KeyError) as e:
            raise ValueError(f"{path}: not a readable rollout shard ({e})") from e
        self.fd = os.open(path, os.O_RDONLY)

    def _read(self, at: int, offsets: np.ndarray, row: int, dtype) -> np.ndarray:
        a, b = int(offsets[row]), int(offsets[row + 1])
        return np.frombuffer(os.pread(self.fd, (b - a) * 4, at + a * 4), dtype=dtype)

    def tokens(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        return (self._read(self.prompt_at, self.prompt_off, r, np.int32),
                self._read(self.resp_at, self.resp_off, r, np.int32))

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (*self.tokens(r), self._read(self.logp_at, self.resp_off, r, np.float32))

    def close(self) -> None:
        os.close(self.fd)


def _allow_open_files(n: int) -> None:
    """Each open shard holds a file descriptor: raise the soft limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        top = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
        if top < want:
            raise ValueError(f"{n} rollout shards need {want} open files, the hard limit is {hard}:"
                             f" raise rollout.shard_prompts (fewer, larger shards) or `ulimit -n`")


BEHAVIOUR_FILE = "behaviour_learner.arrow"
_LOGP_SCHEMA = pa.schema([("logprobs", pa.list_(pa.float32()))])


class LearnerLogprobWriter(AtomicFile):
    """The learner's behaviour log-probs of a phase's responses, in phase order, written a chunk
    of rows at a time; ``commit`` refuses a file that does not hold every row."""

    def __init__(self, directory: Path, num_samples: int):
        super().__init__(directory / BEHAVIOUR_FILE, _LOGP_SCHEMA, "behaviour log-probs")
        self.num_samples, self.rows = num_samples, 0

    def add(self, logprobs: Sequence[np.ndarray]) -> None:
        self.write(pa.record_batch([list_column(logprobs, np.float32, pa.float32())],
                                   schema=_LOGP_SCHEMA))
        self.rows += len(logprobs)

    def commit(self) -> None:
        if self.rows != self.num_samples:
            self.abort()
            raise ValueError(f"{self.rows} rows of behaviour log-probs for a phase of "
                             f"{self.num_samples}")
        super().commit()


class _LogprobFile:
    """The learner's behaviour log-probs, read row by row with ``pread``: each row's file position
    and length in memory (12 bytes a response, as the shards' offsets), found once through a map
    of the file that is closed again."""

    def __init__(self, path: Path, num_samples: int):
        try:
            with buffer_positions(path) as (reader, position):
                at, lengths = [], []
                for k in range(reader.num_record_batches):
                    column = reader.get_batch(k).column(0)
                    offsets = column.offsets.to_numpy().astype(np.int64)
                    at.append(position(column.values.buffers()[1]) + 4 * offsets[:-1])
                    lengths.append(np.diff(offsets))
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path}: not a readable behaviour log-prob file ({e})") from e
        self.at = np.concatenate(at) if at else np.zeros(0, dtype=np.int64)
        self.length = np.concatenate(lengths).astype(np.int32) if lengths else \
            np.zeros(0, dtype=np.int32)
        if len(self.at) != num_samples:
            raise ValueError(f"{path}: {len(self.at)} rows for a phase of {num_samples}")
        self.fd = os.open(path, os.O_RDONLY)

    def row(self, i: int) -> np.ndarray:
        return np.frombuffer(os.pread(self.fd, int(self.length[i]) * 4, int(self.at[i])),
                             dtype=np.float32)

    def close(self) -> None:
        os.close(self.fd)


@dataclass(frozen=True)
class UpdateBatch:
    """One update of a phase, as this rank trains on it."""

    minibatch: Minibatch
    rows: np.ndarray
    """The update's phase rows over every data-parallel rank (a multiple of DP x micro-batch)."""
    batch: TrainBatch | None
    """This rank's share of them, read from the shards (None: too few rows for one microbatch
    on every rank; the update is skipped)."""


class PhaseData:
    """A generated phase as the learner sees it, on every rank, without holding it: the index's
    columns as numpy and each shard open for reading. ``batch(rows)`` reads just those rows;
    ``updates`` yields each update's batch for this rank: the rank's data-parallel share, padded
    with ``pad_id``, both given once here."""

    def __init__(self, directory: Path, drop_uniform: bool, *, pad_id: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 1):
        index = open_table(directory / "index.arrow")
        meta = index.schema.metadata or {}
        names = json.loads(meta[b"shards"])
        self.group_size = int(meta[b"group_size"])
        self.directory = directory
        _allow_open_files(len(names))
        self.shards = [_Shard(directory / name) for name in names]
        self.shard = column(index, "shard")
        self.row = column(index, "row")
        self.reward = column(index, "reward")
        self.advantage = column(index, "advantage")
        self.response_len = column(index, "response_len")
        self.truncated = column(index, "truncated")
        self.uniform = column(index, "uniform")
        self._index = index
        self.train_rows = np.flatnonzero(~self.uniform) if drop_uniform else \
            np.arange(len(self.reward))
        """Rows the updates draw from (the scheduler's sample indices index this)."""
        self.pad_id, self.dp_rank, self.dp_size = pad_id, dp_rank, dp_size
        self.quantum = dp_size * micro_batch_size
        """An update's rows are a multiple of this: every rank gets whole microbatches."""
        self.drawn = np.zeros(len(self.train_rows), dtype=bool)
        """Which train rows an update of ``updates`` has drawn so far."""
        self.draws = 0
        """Rows drawn, repeats counted (the passes made: ``draws / len(train_rows)``)."""
        self._learner: _LogprobFile | None = None

    def has_learner_logprobs(self) -> bool:
        return (self.directory / BEHAVIOUR_FILE).exists()

    def use_learner_logprobs(self) -> None:
        """From now on ``batch`` gives the learner's behaviour log-probs (``BEHAVIOUR_FILE``)
        instead of the engine's."""
        self._learner = _LogprobFile(self.directory / BEHAVIOUR_FILE, self.num_samples)

    @property
    def num_samples(self) -> int:
        return len(self.reward)

    @property
    def num_uniform_groups(self) -> int:
        return int(self.uniform.sum()) // self.group_size

    def response(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prompt ids, response ids and behaviour log-probs of phase row ``i`` (read from disk)."""
        return self.shards[self.shard[i]].row(int(self.row[i]))

    def close(self) -> None:
        for sh in self.shards:
            sh.close()
        self.shards = []
        if self._learner is not None:
            self._learner.close()
            self._learner = None

    def updates(self, schedule: PhaseScheduler, phase: Phase, first: int, once: bool
                ) -> Iterator[UpdateBatch]:
        """The phase's updates from global update ``first`` on (a resume skips the earlier ones,
        which it still counts as drawn), each with this rank's batch: the update's rows are
        ``schedule.update_size`` samples of the train rows (``once``: uniform groups dropped
        once, ``algo.uniform_groups: drop_once``), cut to a multiple of DP x micro-batch, and
        this rank reads its contiguous share of them and nothing else (1 / DP of the update's
        ~12 MB of tokens and log-probs at 10^6 response tokens an update, DP 8). Stops where the
        caller stops (the drift bound ends a phase early)."""
        train = self.train_rows
        if not len(train):
            return
        size = schedule.update_size(len(train), once, self.quantum, phase)
        for mb in schedule.minibatches(phase, len(train), size):
            picked = np.asarray(mb.sample_indices, dtype=np.int64)
            picked = picked[:len(picked) - len(picked) % self.quantum]
            self.drawn[picked] = True
            self.draws += len(picked)
            if mb.update < first:
                continue
            rows = train[picked]
            share = len(rows) // self.dp_size
            mine = rows[self.dp_rank * share:(self.dp_rank + 1) * share]
            yield UpdateBatch(mb, rows, self.batch(mine) if len(rows) else None)

    @property
    def passes(self) -> float:
        """Passes over the train rows that the updates drawn so far made."""
        return self.draws / len(self.train_rows) if len(self.train_rows) else 0.0

    @property
    def unused_frac(self) -> float:
        """The share of the phase's responses that no update drew (generated for nothing): the
        uniform groups dropped, and what an early end left."""
        return 1.0 - int(self.drawn.sum()) / self.num_samples if self.num_samples else 0.0

    def batch(self, rows: Sequence[int] | np.ndarray, multiple_of: int = 1,
              engine_logprobs: bool = False) -> TrainBatch:
        """Right-padded (``pad_id``) prompt+response rows for phase rows ``rows``: reads those
        rows from the shards and nothing else. Memory and time: the batch, whatever the phase's
        size. The behaviour log-probs are the learner's after ``use_learner_logprobs`` (the
        shards' are then not read), else the engine's; ``engine_logprobs`` asks for the
        engine's always."""
        rows = np.asarray(rows, dtype=np.int64)
        learner = None if engine_logprobs else self._learner
        if learner is None:
            picked = [self.response(int(i)) for i in rows]
        else:
            picked = [(*self.shards[self.shard[i]].tokens(int(self.row[i])), learner.row(int(i)))
                      for i in rows]
        return padded_batch(picked, self.advantage[rows], self.pad_id, multiple_of)

    def stats(self) -> dict:
        """The phase's summary numbers (vectorised over the index)."""
        n = max(self.num_samples, 1)
        return {"reward_mean": float(self.reward.mean()), "reward_std": float(self.reward.std()),
                "num_samples": self.num_samples, "num_train_samples": len(self.train_rows),
                "uniform_groups": self.num_uniform_groups,
                "uniform_group_frac": float(self.uniform.sum()) / n,
                "response_len": float(self.response_len.mean()),
                "response_tokens": int(self.response_len.sum(dtype=np.int64)),
                "truncated_frac": float(self.truncated.sum()) / n}

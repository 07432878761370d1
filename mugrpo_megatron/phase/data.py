"""A generated phase read back: the view each rank trains on (``PhaseData``), which yields each
update's batch for that rank, and the per-token log-prob files the learner writes beside the
shards (its behaviour log-probs, a reference policy's). The files are ``phase.store``'s.

What a rank holds, at 10^6 responses: each shard's list offsets (8 B a row), the index's columns
(~50 B a row, a read-only map) and the train rows (8 B): ~66 MB; rows are read with ``pread``,
one update's at a time.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from mugrpo_megatron.arrow_files import AtomicFile, buffer_positions, list_column
from mugrpo_megatron.phase.batches import padded_batch
from mugrpo_megatron.phase.schedule import Minibatch, Phase, PhaseScheduler
from mugrpo_megatron.phase.store import SINGLE_TURN, column, open_table
from mugrpo_megatron.rollout_correction import Correction, correct
from mugrpo_megatron.types import TrainBatch


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
                # trajectories' tool messages (rollout.tools); none in older shards
                self.span_off, self.span_at = _locate(t, "tool_spans", at) \
                    if "tool_spans" in t.column_names else (None, 0)
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

    def spans(self, r: int) -> np.ndarray:
        """Row ``r``'s tool-message spans ([start, end) pairs, flattened; empty: none)."""
        if self.span_off is None or self.span_off[r] == self.span_off[r + 1]:
            return np.zeros(0, dtype=np.int32)
        return self._read(self.span_at, self.span_off, r, np.int32)

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
"""The learner's behaviour log-probs (``algo.behaviour_logprobs: learner``)."""
REFERENCE_FILE = "reference_logprobs.arrow"
"""The reference policy's log-probs (``algo.kl_target: reference``)."""
_LOGP_SCHEMA = pa.schema([("logprobs", pa.list_(pa.float32()))])


class LearnerLogprobWriter(AtomicFile):
    """Per-token log-probs the learner computed of a phase's responses (``BEHAVIOUR_FILE`` or
    ``REFERENCE_FILE``), in phase order, written a chunk of rows at a time; ``commit`` refuses a
    file that does not hold every row."""

    def __init__(self, directory: Path, num_samples: int, name: str = BEHAVIOUR_FILE):
        what = "reference log-probs" if name == REFERENCE_FILE else "behaviour log-probs"
        super().__init__(directory / name, _LOGP_SCHEMA, what)
        self.num_samples, self.rows = num_samples, 0

    def add(self, logprobs: Sequence[np.ndarray]) -> None:
        self.write(pa.record_batch([list_column(logprobs, np.float32, pa.float32())],
                                   schema=_LOGP_SCHEMA))
        self.rows += len(logprobs)

    def commit(self) -> None:
        if self.rows != self.num_samples:
            self.abort()
            raise ValueError(f"{self.rows} rows of {self.what} for a phase of "
                             f"{self.num_samples}")
        super().commit()


class _LogprobFile:
    """A ``LearnerLogprobWriter`` file, read row by row with ``pread``: each row's file position
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
            raise ValueError(f"{path}: not a readable log-prob file ({e})") from e
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
    with ``pad_id``, both given once here. The rows updates draw from leave out the uniform
    groups with ``drop_uniform`` and the responses cut at the length limit with
    ``overlong_filter`` (``algo.overlong_filter``: their advantages, and their groups' others',
    stay as indexed)."""

    def __init__(self, directory: Path, drop_uniform: bool, *, overlong_filter: bool = False,
                 pad_id: int = 0, dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 1,
                 tools: bool = False):
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
        n = len(self.reward)
        # an index written before groups, penalties and sources were kept: none of them
        have = set(index.column_names)
        self.group = column(index, "group") if "group" in have else \
            np.arange(n, dtype=np.int64) // self.group_size
        self.penalty = column(index, "penalty") if "penalty" in have else np.zeros(n)
        self.source = column(index, "source") if "source" in have else np.zeros(n, np.int32)
        for name, default in SINGLE_TURN.items():  # an index from before trajectories: none
            setattr(self, name, column(index, name) if name in have else
                    np.full(n, default, np.int32))
        self.has_tools = bool(self.tool_calls.any())
        """Whether any response of the phase called a tool (its batches then mask tool tokens)."""
        self.tools = tools or self.has_tools
        """Whether the phase was sampled with tools (``rollout.tools``): its trajectory numbers
        are reported, at 0 where nothing called."""
        self.sources: list[str] = json.loads(meta.get(b"sources", b'[""]'))
        self.planned_groups = int(meta.get(b"planned_groups", n // self.group_size))
        """The groups the phase was planned for; refill's further groups are beyond them."""
        self._index = index
        dropped = self.uniform if drop_uniform else np.zeros(n, dtype=bool)
        filtered = self.truncated & ~dropped if overlong_filter else np.zeros(n, dtype=bool)
        self.overlong_filtered = int(filtered.sum())
        """Responses cut at the length limit that the filter took out of the train rows (those
        of dropped uniform groups not counted twice)."""
        self.train_rows = np.flatnonzero(~(dropped | filtered))
        """Rows the updates draw from (the scheduler's sample indices index this)."""
        self.pad_id, self.dp_rank, self.dp_size = pad_id, dp_rank, dp_size
        self.quantum = dp_size * micro_batch_size
        """An update's rows are a multiple of this: every rank gets whole microbatches."""
        self.drawn = np.zeros(len(self.train_rows), dtype=bool)
        """Which train rows an update of ``updates`` has drawn so far."""
        self.draws = 0
        """Rows drawn, repeats counted (the passes made: ``draws / len(train_rows)``)."""
        self._learner: _LogprobFile | None = None
        self._reference: _LogprobFile | None = None
        self._correction: Correction | None = None

    def has_learner_logprobs(self) -> bool:
        return (self.directory / BEHAVIOUR_FILE).exists()

    def use_learner_logprobs(self, correction: Correction | None = None) -> None:
        """From now on ``batch`` gives the learner's behaviour log-probs (``BEHAVIOUR_FILE``)
        instead of the engine's, corrected for the engine's sampling by ``correction``
        (``algo.rollout_is`` / ``rollout_rs``: ``rollout_correction``)."""
        self._learner = _LogprobFile(self.directory / BEHAVIOUR_FILE, self.num_samples)
        self._correction = correction

    def has_reference_logprobs(self) -> bool:
        return (self.directory / REFERENCE_FILE).exists()

    def use_reference_logprobs(self) -> None:
        """From now on ``batch`` gives the reference policy's log-probs too (``ref_logp``)."""
        self._reference = _LogprobFile(self.directory / REFERENCE_FILE, self.num_samples)

    @property
    def num_samples(self) -> int:
        return len(self.reward)

    @property
    def num_groups(self) -> int:
        return self.num_samples // self.group_size

    @property
    def positions_used(self) -> int:
        """Prompt positions of the run's stream the phase used: past its last group (refill's
        groups go beyond its planned prompts)."""
        return int(self.group.max()) + 1 if len(self.group) else self.planned_groups

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
        for name in ("_learner", "_reference"):
            if getattr(self, name) is not None:
                getattr(self, name).close()
                setattr(self, name, None)

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
        if not len(train):  # every group uniform and dropped, every response filtered out:
            for step in range(phase.max_updates):  # the updates happen, skipped, and count
                mb = Minibatch(phase.first_update + step, step, 0, ())
                if mb.update >= first:
                    yield UpdateBatch(mb, np.zeros(0, dtype=np.int64), None)
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
        uniform groups dropped, the responses filtered out, and what an early end left."""
        return 1.0 - int(self.drawn.sum()) / self.num_samples if self.num_samples else 0.0

    def batch(self, rows: Sequence[int] | np.ndarray, multiple_of: int = 1,
              engine_logprobs: bool = False) -> TrainBatch:
        """Right-padded (``pad_id``) prompt+response rows for phase rows ``rows``: reads those
        rows from the shards and nothing else. Memory and time: the batch, whatever the phase's
        size. The behaviour log-probs are the learner's after ``use_learner_logprobs`` (the
        shards' are then not read), else the engine's; ``engine_logprobs`` asks for the
        engine's always. After ``use_reference_logprobs`` the batch carries the reference's."""
        rows = np.asarray(rows, dtype=np.int64)
        learner = None if engine_logprobs else self._learner
        correct_it = learner is not None and self._correction is not None
        if learner is None or correct_it:
            engine = [self.response(int(i)) for i in rows]
        if learner is None:
            picked = engine
        elif correct_it:
            picked = [(p, r, learner.row(int(i))) for (p, r, _), i in zip(engine, rows)]
        else:
            picked = [(*self.shards[self.shard[i]].tokens(int(self.row[i])), learner.row(int(i)))
                      for i in rows]
        ref = [self._reference.row(int(i)) for i in rows] if self._reference is not None and \
            not engine_logprobs else None
        spans = [self.shards[self.shard[i]].spans(int(self.row[i])) for i in rows] \
            if self.has_tools else None
        batch = padded_batch(picked, self.advantage[rows], self.pad_id, multiple_of,
                             ref_logprobs=ref, tool_spans=spans)
        if not correct_it:
            return batch
        # the engine's log-probs beside the learner's: a second padding of the same rows (one
        # update's rows, [B, S] a few bytes a token: nothing beside the update's forward pass)
        rollout = padded_batch(engine, self.advantage[rows], self.pad_id, multiple_of)
        weight, keep = correct(batch.behav_logp, rollout.behav_logp, batch.response_mask,
                               self._correction)
        return replace(batch, response_mask=keep, is_weight=weight)

    def trajectory_stats(self, rows: np.ndarray) -> dict:
        """The trajectories of phase rows ``rows`` in numbers (none for a phase sampled without
        tools): model turns and tool calls a response, the share of calls that failed, of the
        responses' tokens that tool messages hold, and of responses that called (vectorised)."""
        if not self.tools:
            return {}
        calls = int(self.tool_calls[rows].sum())
        tokens = int(self.response_len[rows].sum(dtype=np.int64))
        n = max(len(rows), 1)
        return {"turns": float(self.turns[rows].sum()) / n, "tool_calls": calls / n,
                "tool_error_frac": int(self.tool_errors[rows].sum()) / calls if calls else 0.0,
                "tool_token_frac": int(self.tool_tokens[rows].sum()) / tokens if tokens else 0.0,
                "tool_call_response_frac": float((self.tool_calls[rows] > 0).sum()) / n}

    @staticmethod
    def describe_tools(stats: dict) -> str:
        """``trajectory_stats``' numbers in words ('' for a phase sampled without tools)."""
        if "tool_calls" not in stats:
            return ""
        return (f", tools: {stats['tool_calls']:.2f} calls a response "
                f"({stats['tool_error_frac']:.0%} failed, {stats['tool_call_response_frac']:.0%}"
                f" of responses called), {stats['turns']:.2f} turns, tool messages "
                f"{stats['tool_token_frac']:.0%} of tokens")

    def stats(self) -> dict:
        """The phase's summary numbers (vectorised over the index): the task reward (without the
        overlong penalty) overall and by source, and what was left out of training."""
        n = max(self.num_samples, 1)
        by_source = {name: float(self.reward[self.source == code].mean())
                     for code, name in enumerate(self.sources) if (self.source == code).any()}
        out = {"reward_mean": float(self.reward.mean()), "reward_std": float(self.reward.std()),
               "reward_by_source": by_source,
               "num_samples": self.num_samples, "num_train_samples": len(self.train_rows),
               "groups": self.num_groups, "planned_groups": self.planned_groups,
               "prompts_used": self.positions_used,
               "uniform_groups": self.num_uniform_groups,
               "uniform_group_frac": float(self.uniform.sum()) / n,
               "response_len": float(self.response_len.mean()),
               "response_tokens": int(self.response_len.sum(dtype=np.int64)),
               "truncated_frac": float(self.truncated.sum()) / n,
               "overlong_filtered": self.overlong_filtered}
        out.update(self.trajectory_stats(np.arange(self.num_samples)))
        if self.penalty.any():
            out["overlong_penalty_mean"] = float(self.penalty.mean())
            out["shaped_reward_mean"] = float((self.reward + self.penalty).mean())
        return out



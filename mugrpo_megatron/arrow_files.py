"""The Arrow IPC files a run writes and reads back row by row: the rollout shards, a phase's index
and its learner behaviour log-probs (``phase.store``), the prompt file (``data.prompt_store``).

- ``AtomicFile``: written beside its name (``.NAME.tmp``), fsynced and renamed into place once
  complete, so a reader sees a whole file or none and a kill leaves at most a temporary file; a
  full disk becomes ``outputs.DiskFull`` naming the file and what was kept.
- ``buffer_positions``: where each buffer of a file begins, found once through a map that is
  closed again, so that rows are then read with ``pread`` (a map would keep every page a read
  faulted in, and the pages around it, in the rank's memory).
- ``list_column``: a list<T> column (int32 offsets, flat values) from sequences.

No torch here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from mugrpo_megatron import outputs


def list_column(seqs: Sequence, np_type, pa_type) -> pa.ListArray:
    """``seqs`` (sequences of numbers) as one list column: int32 offsets, flat values."""
    lengths = np.fromiter((len(x) for x in seqs), dtype=np.int32, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([np.asarray(x, dtype=np_type) for x in seqs]) if len(seqs) else \
        np.zeros(0, dtype=np_type)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa_type))


class AtomicFile:
    """An Arrow IPC file of ``schema`` written beside ``path`` and renamed to it by ``commit``;
    ``abort`` (or an exception out of its ``with`` block) removes the partial file. ``what`` names
    it in a full disk's message."""

    def __init__(self, path: Path, schema: pa.Schema, what: str):
        self.path, self.what = Path(path), what
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        with self._guard():
            self._sink = pa.OSFile(str(self.tmp), "wb")
            self._writer = pa.ipc.new_file(self._sink, schema)

    def _guard(self):
        return outputs.guard(self.path, self.what, kept=outputs.KEPT, then=outputs.RESUME)

    def write(self, data: pa.RecordBatch | pa.Table) -> None:
        """One record batch (a table is written as one batch)."""
        with self._guard():
            if isinstance(data, pa.Table):
                self._writer.write_table(data, max_chunksize=max(data.num_rows, 1))
            else:
                self._writer.write_batch(data)

    def commit(self) -> None:
        """Close, fsync and rename into place (the partial file removed if any of it fails)."""
        try:
            with self._guard():
                self._writer.close()
                self._sink.close()
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
        except BaseException:
            self.abort()
            raise
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drop the partial file (it holds space and never takes the name)."""
        for closing in (self._writer.close, self._sink.close):
            with contextlib.suppress(OSError, pa.ArrowException):
                closing()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


@contextlib.contextmanager
def buffer_positions(path: Path) -> Iterator[tuple[pa.ipc.RecordBatchFileReader,
                                                   Callable[[pa.Buffer | None], int]]]:
    """The file's reader, through a map, and ``at(buffer)``: the file position where a buffer of
    it begins (its address less the mapping's first byte, the buffers being zero-copy views of
    the map), 0 for an absent or empty buffer. Only metadata pages are touched; the map is
    closed on leaving, and nothing read through it may be used after."""
    src = pa.memory_map(str(path))
    try:
        base = src.read_buffer(1).address  # the mapping's first byte (a zero-copy read)

        def at(buffer: pa.Buffer | None) -> int:
            # an empty buffer (a string column of '' only) may live outside the map: nothing
            # is read from it
            return buffer.address - base if buffer is not None and buffer.size else 0

        yield pa.ipc.open_file(src), at
    finally:
        src.close()

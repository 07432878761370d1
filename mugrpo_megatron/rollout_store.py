"""Each phase's rollouts on disk, as parquet, written atomically as they are produced.

``rollouts/phase_0003/part_00002.parquet`` holds the scored samples of one generation chunk;
``rollouts/phase_0003/final.parquet`` (written last) holds the whole phase with advantages. A run
killed during generation keeps its finished parts; one killed after ``final.parquet`` never
generates that phase again.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mugrpo_megatron.rollout import Sample

_SCHEMA = pa.schema([
    ("phase", pa.int32()), ("prompt_index", pa.int64()), ("group", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
    ("behav_logprobs", pa.list_(pa.float32())), ("finish_reason", pa.string()),
    ("reward", pa.float64()), ("advantage", pa.float64()),
])


class RolloutStore:
    def __init__(self, run_dir: Path):
        self.root = run_dir / "rollouts"

    def _dir(self, phase: int) -> Path:
        return self.root / f"phase_{phase:04d}"

    def write_part(self, phase: int, part: int, samples: list[Sample]) -> None:
        self._write(self._dir(phase) / f"part_{part:05d}.parquet", samples)

    def parts(self, phase: int) -> dict[int, list[Sample]]:
        d = self._dir(phase)
        if not d.is_dir():
            return {}
        return {int(p.stem.split("_")[1]): self._read(p) for p in sorted(d.glob("part_*.parquet"))}

    def write_final(self, phase: int, samples: list[Sample]) -> None:
        self._write(self._dir(phase) / "final.parquet", samples)

    def final(self, phase: int) -> list[Sample] | None:
        path = self._dir(phase) / "final.parquet"
        return self._read(path) if path.exists() else None

    @staticmethod
    def _write(path: Path, samples: list[Sample]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        columns = {f.name: [getattr(s, f.name) for s in samples] for f in fields(Sample)}
        table = pa.table({k: [list(v) if isinstance(v, tuple) else v for v in vals]
                          for k, vals in columns.items()}, schema=_SCHEMA)
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none

    @staticmethod
    def _read(path: Path) -> list[Sample]:
        rows = pq.read_table(path).to_pylist()
        return [Sample(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})
                for r in rows]


assert {f.name for f in fields(Sample)} == set(_SCHEMA.names), "Sample and the parquet schema differ"

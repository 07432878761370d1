"""The training prompts as one columnar file in the run directory: tokenized once, by rank 0, and
read by every rank a prompt at a time.

::

    run_dir/prompts/train_<key>.arrow   Arrow IPC, uncompressed, record batches of ~BATCH_ROWS
                                        prompts: source row (int64), the prompt as rendered, gold
                                        answer, token ids (list<int32>: offsets, flat values),
                                        source (int32, into the record's sources), metadata (the
                                        row's data.metadata_fields as JSON, '' without)
    run_dir/prompts/train_<key>.json    written last: the prompt count, each file's, the sources
                                        and the load report (rows read, skipped and why); its
                                        presence means the file is complete

A mixture (``data.path`` a list) is one file: each path's kept prompts in turn, in
``data.path`` order; the record says how many each has, for the scheduler's mixture draw.

``key`` hashes what the token ids depend on (``prompt_key``): every ``data.`` key of the run's
fingerprint (file, fields, template, chat template, limits, the data file's content hash), the
model directory's config and tokenizer files' content hashes, and this format's version. A
resumed run finds its file and reuses it; any change that would change a token is another file.

Who does what: rank 0 reads the data set as a stream, checks, tokenizes and writes it a chunk at
a time, with progress, before any process group exists (``inputs.prepare_data``), into a staging
directory beside the run directory (``staging_dir``: nothing goes into the run directory before
every rank agreed it sees the same one), and moves it in once they have (``open_prompt_set``,
collective; the other ranks wait in one collective, which also carries rank 0's error). Then every rank
opens the file: it reads the footer and each batch's header (where each column's buffers are)
and nothing per prompt (a prompt's batch is found by bisection). A prompt is read with ``pread``
through the page cache (one read of 8 bytes and one of its tokens for its token ids, seven
reads for the whole prompt), so a rank's memory does not grow with the prompt set, nor as the
phases read their way through it; a map would (each page fault maps the pages around it, as
``phase.store`` measured for shards).

What grows with what, at 10^6 prompts of 300 tokens: on disk ~1.2 GB of token ids plus the texts
(as rendered: ~1.2 KB a prompt), answers, 4 B of source and the metadata's JSON (100 MB at 100
bytes a prompt), once per run directory; in each rank ~100 bytes a batch (122 batches); at start-up,
rank 0's time to tokenize (the other 63 ranks tokenize nothing) and on rank 0 one chunk of
prompts as Python objects (1024 x 300 tokens: ~45 MB with the tokenizer's own) and one batch as
Arrow arrays (~10 MB). Before, every rank tokenized the whole set and held every prompt as a tuple
of Python ints (~36 bytes a token: 10.8 GB a rank here, 2.7 GB at 2.5 x 10^5 prompts).
The held-out set (``data.eval_size`` prompts) stays a list (``load_prompts``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from mugrpo_megatron import outputs
from mugrpo_megatron.arrow_files import AtomicFile, buffer_positions, list_column
from mugrpo_megatron.config import Config
from mugrpo_megatron.data import CHUNK_ROWS, PromptChunk, Tokenizer, iter_prompt_chunks
from mugrpo_megatron.distributed import on_rank0, world
from mugrpo_megatron.types import LoadReport, Prompt

FORMAT_VERSION = 2
"""2: sources, metadata and the rendered prompt (1: the dataset's prompt text)."""
BATCH_ROWS = 8192
"""Prompts a record batch holds (about): opening a file reads each batch's header, and every
page it touches maps the pages around it (~64 KB), so batches stay few (122 at 10^6 prompts)."""
SCHEMA = pa.schema([("row", pa.int64()), ("text", pa.string()), ("answer", pa.string()),
                    ("token_ids", pa.list_(pa.int32())), ("source", pa.int32()),
                    ("metadata", pa.string())])


def prompt_key(cfg: Config) -> str:
    """16 hex digits naming what the prompt file's contents depend on (see the module
    docstring); the run fingerprint's data and model parts, so one definition serves both."""
    from mugrpo_megatron.run_dir import fingerprint

    fp = fingerprint(cfg)
    parts = {k: v for k, v in fp.items()
             if k.startswith("data.") and not k.startswith("data.eval")}
    parts.update({"model.files_sha256": fp["model.files_sha256"],
                  "model.trust_remote_code": cfg.model.trust_remote_code,
                  "format": FORMAT_VERSION})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def prompt_paths(run_dir: Path, key: str) -> tuple[Path, Path]:
    """The prompt file and its completion record."""
    base = run_dir / "prompts" / f"train_{key}"
    return base.with_suffix(".arrow"), base.with_suffix(".json")


def staging_dir(run_dir: Path) -> Path:
    """Where rank 0 writes the prompt file before any process group exists (``inputs``): beside
    the run directory, not in it, so that nothing is in ``run_dir`` before every rank agreed it
    sees the same one (``run_dir.agree``); on the same file system, so that moving the file in
    (``open_prompt_set``) is a rename."""
    return run_dir.parent / f".{run_dir.name}.mugrpo-staging"


def discard_staging(run_dir: Path, made: Sequence[Path] = ()) -> None:
    """Remove the staged prompt files and the staging directory, then the directories of
    ``made`` (deepest first) that are empty: what a start that stops before agreeing leaves."""
    staging = staging_dir(run_dir)
    for f in sorted((staging / "prompts").glob("train_*")):
        f.unlink()
    for d in (staging / "prompts", staging, *made):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def _promote(run_dir: Path, key: str) -> bool:
    """Move a complete staged prompt file into ``run_dir`` (the file, then its record); False
    when none is staged."""
    staged, staged_done = prompt_paths(staging_dir(run_dir), key)
    if not staged_done.is_file():
        return False
    path, done = prompt_paths(run_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, path)
    os.replace(staged_done, done)
    discard_staging(run_dir)
    return True


def open_prompt_set(cfg: Config, run_dir: Path, tokenizer: Tokenizer,
                    note: Callable[[str], None] = lambda _: None, bar=None,
                    other_sources: Sequence[str] = ()) -> PromptSet:
    """The run's training prompts (collective: every rank calls it): rank 0 moves the file
    ``inputs.prepare_data`` staged into the run directory, or tokenizes the data set there,
    unless a complete file for this data and tokenizer is there already; every rank then opens
    it. ``note`` and ``bar(desc, total)`` report on rank 0.
    ``other_sources``: the held-out sets', which ``reward.by_source`` may name too."""
    key = prompt_key(cfg) if world()[0] == 0 else ""
    path, done = prompt_paths(run_dir, key)

    def build() -> str:
        if done.is_file():
            note(f"prompts: reusing {path}")
        elif _promote(run_dir, key):
            note(f"prompts: {path} (tokenized before the process groups)")
        else:
            write_prompt_file(cfg, tokenizer, path, done, bar, other_sources=other_sources)
        return str(path)

    return PromptSet(Path(on_rank0(build)))  # rank 0's path (its key) on every rank


def write_prompt_file(cfg: Config, tokenizer: Tokenizer, path: Path, done: Path, bar=None,
                      chunk_rows: int = CHUNK_ROWS, batch_rows: int = BATCH_ROWS,
                      other_sources: Sequence[str] = ()) -> LoadReport:
    """Stream every ``data.path`` through ``iter_prompt_chunks`` (``chunk_rows`` rows tokenized
    at a time) into ``path``, in record batches of about ``batch_rows`` prompts (written beside
    it, fsynced, renamed: ``arrow_files.AtomicFile``), then ``done``. Holds one chunk as Python
    objects and one batch as Arrow arrays (~5 bytes a token). ValueError, and nothing written,
    for a bad row or a ``reward.by_source`` key that neither these files nor ``other_sources``
    (the held-out sets') yield."""
    made = [d for d in (path.parent, *path.parents) if not d.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    total = LoadReport(source=", ".join(cfg.data.paths))
    progress = bar("tokenizing the training prompts", None) if bar is not None else None
    kept, held, sources = [], [], {}
    try:
        with AtomicFile(path, SCHEMA, "prompt set") as out:
            for file in cfg.data.paths:
                report = LoadReport(source="(none)")
                kept.append(0)
                for chunk in iter_prompt_chunks(cfg.data, tokenizer, report, path=file,
                                                chunk_rows=chunk_rows):
                    if len(chunk):
                        held.append(_record_batch(chunk, sources))
                    kept[-1] += len(chunk)
                    if sum(b.num_rows for b in held) >= batch_rows:
                        out.write(pa.Table.from_batches(held).combine_chunks())
                        held = []
                    if progress is not None:
                        progress.update(len(chunk))
                total.add(report)
            if held:
                out.write(pa.Table.from_batches(held).combine_chunks())
            check_routes(cfg, [*sources, *other_sources])
        with outputs.guard(done, "prompt set", kept=outputs.KEPT, then=outputs.RESUME):
            outputs.write_file(done, json.dumps({
                "num_prompts": sum(kept), "file_prompts": kept, "sources": list(sources),
                "report": asdict(total)}, indent=1))
    except BaseException:
        for d in made:  # deepest first: what this call made, so a failed start leaves nothing
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    finally:
        if progress is not None:
            progress.close()
    return total


def check_routes(cfg: Config, sources: Sequence[str]) -> None:
    """ValueError naming a ``reward.by_source`` key that no data file yields (a typo would
    otherwise score its prompts with reward.name, silently)."""
    for key in cfg.reward.by_source:
        if key not in sources:
            raise ValueError(f"reward.by_source.{key}: no prompt has that source; the data "
                             f"files' sources are {sorted(set(sources))} (data.source_field "
                             f"{cfg.data.source_field!r}, else each file's stem)")


def _record_batch(c: PromptChunk, sources: dict[str, int]) -> pa.RecordBatch:
    codes = [sources.setdefault(name, len(sources)) for name in c.sources]
    return pa.record_batch([
        pa.array(c.rows, pa.int64()), pa.array(c.texts, pa.string()),
        pa.array(c.answers, pa.string()), list_column(c.token_ids, np.int32, pa.int32()),
        pa.array(codes, pa.int32()), pa.array(c.metadata, pa.string())], schema=SCHEMA)


@dataclass(frozen=True)
class _Batch:
    """Where one record batch's buffers are in the file (byte positions)."""

    first: int
    """The batch's first prompt."""
    row: int
    text_offsets: int
    text: int
    answer_offsets: int
    answer: int
    ids_offsets: int
    ids: int
    source: int
    metadata_offsets: int
    metadata: int


class PromptSet(Sequence[Prompt]):
    """The training prompts of a prompt file, read one at a time (``pread``). Indexes are kept
    prompts, 0-based, as the scheduler draws them; ``Prompt.index`` is the source row."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            meta = json.loads(self.path.with_suffix(".json").read_text())
            self.report = LoadReport(**meta["report"])
            self._len = int(meta["num_prompts"])
            self.file_sizes: tuple[int, ...] = tuple(meta["file_prompts"])
            """Kept prompts of each ``data.path`` file, in order (a mixture's draw)."""
            self.sources: list[str] = list(meta["sources"])
            """Every source of the set, by the code its prompts store."""
            self._batches = _locate_batches(self.path, self._len)
            self._firsts = [b.first for b in self._batches]
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowInvalid) as e:
            raise ValueError(f"{self.path}: not a complete prompt file of this version ({e}); "
                             f"delete it and its .json to tokenize the data set again") from e
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return self._len

    def _where(self, i: int) -> tuple[_Batch, int]:
        if not 0 <= i < self._len:
            raise IndexError(f"prompt {i} of {self._len}")
        batch = self._batches[bisect.bisect_right(self._firsts, i) - 1]
        return batch, i - batch.first

    def _span(self, offsets_at: int, r: int) -> tuple[int, int]:
        return struct.unpack("<2i", os.pread(self._fd, 8, offsets_at + 4 * r))

    def _bytes(self, offsets_at: int, data_at: int, r: int, width: int) -> bytes:
        a, b = self._span(offsets_at, r)
        return os.pread(self._fd, (b - a) * width, data_at + a * width)

    def token_ids(self, i: int) -> np.ndarray:
        """Prompt ``i``'s token ids (int32), read from the file."""
        batch, r = self._where(i)
        return np.frombuffer(self._bytes(batch.ids_offsets, batch.ids, r, 4), dtype=np.int32)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        batch, r = self._where(int(i))
        (row,) = struct.unpack("<q", os.pread(self._fd, 8, batch.row + 8 * r))
        (source,) = struct.unpack("<i", os.pread(self._fd, 4, batch.source + 4 * r))
        text = lambda at, data: self._bytes(at, data, r, 1).decode("utf-8")  # noqa: E731
        return Prompt(index=row, text=text(batch.text_offsets, batch.text),
                      answer=text(batch.answer_offsets, batch.answer),
                      token_ids=tuple(self.token_ids(int(i)).tolist()),
                      source=self.sources[source],
                      metadata=text(batch.metadata_offsets, batch.metadata))

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(self._len))

    def ids_view(self, indices: Sequence[int]) -> Sequence[list[int]]:
        """The token ids of prompts ``indices``, read when an item is asked for: what an engine
        streams from, so a replica holds only the prompts in flight, not its share."""
        return _IdsView(self, indices)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _IdsView(Sequence[list[int]]):
    def __init__(self, prompts: PromptSet, indices: Sequence[int]):
        self.prompts, self.indices = prompts, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.prompts.token_ids(int(self.indices[i])).tolist()


def _locate_batches(path: Path, num_prompts: int) -> list[_Batch]:
    """The file position of every batch's buffers (``arrow_files.buffer_positions``: only the
    metadata is read). Checks the schema, the prompt count and that nothing is null."""
    with buffer_positions(path) as (reader, at):
        if not reader.schema.equals(SCHEMA):
            raise ValueError(f"schema {reader.schema} is not {SCHEMA}")
        out, total = [], 0
        for k in range(reader.num_record_batches):
            b = reader.get_batch(k)
            if not b.num_rows or any(c.null_count or c.offset for c in b.columns):
                raise ValueError(f"batch {k} is empty or holds nulls")
            row, text, answer, ids, source, metadata = b.columns
            out.append(_Batch(
                first=total, row=at(row.buffers()[1]), text_offsets=at(text.buffers()[1]),
                text=at(text.buffers()[2]), answer_offsets=at(answer.buffers()[1]),
                answer=at(answer.buffers()[2]), ids_offsets=at(ids.buffers()[1]),
                ids=at(ids.values.buffers()[1]), source=at(source.buffers()[1]),
                metadata_offsets=at(metadata.buffers()[1]), metadata=at(metadata.buffers()[2])))
            total += b.num_rows
    if total != num_prompts:
        raise ValueError(f"{total} prompts, the record says {num_prompts}")
    return out

"""Reading a data set's rows, as they are, from a local JSON-lines, JSON or parquet file, a hub
dataset (HF datasets, offline from its cache here) or the builtin arithmetic task: one row at a
time, nothing read ahead, so memory does not grow with the file (``loading`` checks each row and
tokenizes chunks of them).

A file that cannot be read is named with the setting that names it (``key``) and the cause: a
missing or empty file, a parquet file that is not parquet or holds no rows (read from its footer
before HF datasets, whose own message is a low-level Arrow error logged with the file's path),
JSON that is not UTF-8 (where it stops being). HF datasets' logger is silenced while it reads,
so that no line of its comes ahead of ours.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from mugrpo_megatron.config import DataConfig
from mugrpo_megatron.data.arithmetic import arithmetic_rows

BUILTIN_ARITHMETIC = "builtin:arithmetic"
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CHUNK_ROWS = 1024
"""Rows tokenized in one call (fast tokenizers batch them in Rust). Their per-token objects
(~150 bytes a token, Rust and Python) are what a reader holds: ~20 MB at 1024 x 128 tokens."""


class DataNotFound(ValueError):
    """A data file that is not on this machine, or a hub dataset that cannot be loaded here."""


class BadRow(ValueError):
    """A row that cannot become a prompt; ``reason`` is short, for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# A row as read: the record, or the reason it could not be read; and its line (JSON lines only).
Row = tuple["dict | BadRow", "int | None"]


def required_fields(cfg: DataConfig) -> dict[str, str]:
    """The fields every row must have, by the setting that names them."""
    out = {"data.prompt_field": cfg.prompt_field, "data.answer_field": cfg.answer_field}
    out.update({f"data.metadata_fields[{i}]": f for i, f in enumerate(cfg.metadata_fields)})
    return out


def read_rows(path: str, cfg: DataConfig, *, held_out: bool, key: str
              ) -> tuple[Iterator[Row], str, bool]:
    """The rows of ``path`` as an iterator (nothing read ahead), its name for messages, and
    whether its columns were checked already."""
    if path == BUILTIN_ARITHMETIC:
        train = arithmetic_rows(cfg.num_arithmetic_problems, max_operand=cfg.arithmetic_max_operand,
                                seed=cfg.seed)
        if not held_out:
            return ((r, None) for r in train), BUILTIN_ARITHMETIC, True
        exclude = frozenset(r["question"] for r in train)
        held = arithmetic_rows(cfg.eval_size, max_operand=cfg.arithmetic_max_operand,
                               seed=cfg.seed + 1_000_003, exclude=exclude)
        return ((r, None) for r in held), f"{BUILTIN_ARITHMETIC} (held out)", True
    local = Path(path)
    fmt = _FILE_FORMATS.get(local.suffix.lower())
    if fmt is not None:
        if not local.is_file():
            raise DataNotFound(f"{key}: file not found: {path}")
        if local.stat().st_size == 0:
            raise ValueError(f"{key}: {path} is empty")
    elif local.exists():
        raise ValueError(f"{key}: {path} is not a .jsonl, .json or .parquet file")
    if local.suffix.lower() == ".jsonl":
        return _jsonl_rows(local), str(local), False
    if fmt == "parquet":
        _check_parquet(local, key)
    import datasets  # heavy; only when a real dataset is read

    datasets.disable_progress_bars()
    if fmt is not None:
        try:
            with _quiet(datasets):
                ds = datasets.load_dataset(fmt, data_files=str(local), split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps every parse error; say where
            problem = _utf8_problem(local) if fmt == "json" else ""
            raise ValueError(f"{key}: cannot read {path}: {problem or _cause(e)}") from e
        source = str(local)
    else:
        try:
            with _quiet(datasets):
                ds = datasets.load_dataset(path, split=cfg.split)
        except Exception as e:
            raise DataNotFound(f"{key}: {path!r} is neither a local file nor a loadable hub "
                               f"dataset (split {cfg.split!r}): {_cause(e)}") from e
        source = path
    columns = []
    for setting, name in required_fields(cfg).items():  # the top-level column each lives in
        top = name if name in ds.column_names else name.split(".", 1)[0]
        if top not in ds.column_names:
            raise ValueError(f"{source}: no column {name!r} ({setting}); columns are "
                             f"{ds.column_names}")
        columns.append(top)
    source_top = cfg.source_field if cfg.source_field in ds.column_names else \
        cfg.source_field.split(".", 1)[0]
    if source_top in ds.column_names:
        columns.append(source_top)
    # the nested fields are checked row by row (a struct column can lack a key in some rows)
    checked = all("." not in n or n in ds.column_names for n in required_fields(cfg).values())
    return _dataset_rows(ds.select_columns(list(dict.fromkeys(columns)))), source, checked


def _check_parquet(path: Path, key: str) -> None:
    """ValueError naming ``key`` and the file for a file that is not parquet or holds no rows:
    read from its footer (a few KB) before HF datasets, whose own message for either is a
    low-level Arrow error, logged with the file's path before it raises."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not parquet
        raise ValueError(f"{key}: {path} is not a parquet file ({e})") from None
    if meta.num_rows == 0:
        raise ValueError(f"{key}: {path} has no rows (a parquet file with columns "
                         f"{meta.schema.names} and no data)")


@contextlib.contextmanager
def _quiet(datasets) -> Iterator[None]:
    """HF datasets' logger silenced while it reads: it logs a failure (with the file's path)
    before raising it, and ours names the setting, the file and the cause after it."""
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL + 10)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _cause(e: BaseException) -> str:
    """The innermost cause of a wrapped error (HF datasets wraps a reader's error in its own)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}"


def _dataset_rows(ds) -> Iterator[Row]:
    """An HF dataset's rows, read from its memory-mapped Arrow cache a batch at a time."""
    for batch in ds.iter(batch_size=CHUNK_ROWS):
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            yield dict(zip(names, values)), None


def _jsonl_rows(path: Path) -> Iterator[Row]:
    """Every non-blank line of a JSON-lines file, parsed, with its line number, as it is read.

    Written here rather than read through HF datasets, which stops at the first malformed line
    without naming it: a line that is not UTF-8, not JSON or not an object becomes a ``BadRow``
    for that line, so ``data.on_bad_row: skip`` skips it like any other bad row."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield BadRow("not UTF-8", f"not UTF-8 text (byte {e.start} of the line)"), lineno
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield BadRow("invalid JSON", f"invalid JSON: {e.msg} (character {e.pos + 1})"), \
                    lineno
                continue
            if not isinstance(obj, dict):
                yield BadRow("not an object", f"expected a JSON object, got "
                                              f"{type(obj).__name__}"), lineno
                continue
            yield obj, lineno


def _utf8_problem(path: Path) -> str:
    """Where a file stops being UTF-8 text ('' if it is)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"not UTF-8 text at line {line} (byte {e.start})"
    return ""

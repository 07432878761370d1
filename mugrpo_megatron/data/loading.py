"""Prompt datasets: local jsonl/json/parquet or hub ids through HF datasets, or the builtin task.

Rows are read as a stream (a JSON-lines file line by line, parquet/json and hub datasets from HF
datasets' Arrow cache a batch at a time), checked one by one and tokenized a chunk at a time in one
tokenizer call (``iter_prompt_chunks``): nothing here holds the whole data set, so memory does not
grow with it. ``load_prompts`` collects the chunks into ``Prompt`` objects (the held-out set, the
eval command); the trainer writes them to a columnar file instead (``prompt_store``).

A malformed row (missing field, wrong type, empty answer, prompt over ``data.max_prompt_tokens``
after the chat template) stops loading with an error naming the file and row, or, with
``data.on_bad_row: skip``, is skipped and counted in the ``LoadReport``.

The tokenizer is any Hugging Face tokenizer (``apply_chat_template`` and ``__call__``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mugrpo_megatron.config import DataConfig
from mugrpo_megatron.data.arithmetic import arithmetic_rows
from mugrpo_megatron.types import LoadReport, Prompt

BUILTIN_ARITHMETIC = "builtin:arithmetic"
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_MAX_EXAMPLES = 5
CHUNK_ROWS = 1024
"""Rows tokenized in one call (fast tokenizers batch them in Rust). Their per-token objects
(~150 bytes a token, Rust and Python) are what a reader holds: ~20 MB at 1024 x 128 tokens."""


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def __call__(self, text: str | list[str], **kwargs: Any) -> Any: ...


class BadRow(ValueError):
    """A row that cannot become a prompt; ``reason`` is short, for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class PromptChunk:
    """Consecutive kept prompts, column by column."""

    rows: list[int] = field(default_factory=list)
    """Row of the source data set of each prompt (0-based)."""
    texts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def prompts(self) -> list[Prompt]:
        return [Prompt(index=i, text=t, answer=a, token_ids=tuple(ids))
                for i, t, a, ids in zip(self.rows, self.texts, self.answers, self.token_ids)]


def load_prompts(cfg: DataConfig, tokenizer: Tokenizer, *, held_out: bool = False
                 ) -> tuple[list[Prompt], LoadReport]:
    """The training prompts (or, with ``held_out``, the first ``data.eval_size`` evaluation
    prompts), tokenized, as Python objects (~40 bytes a token: for sets of thousands, not a
    training set of millions; the trainer maps those, ``prompt_store``)."""
    report = LoadReport(source="(none)")
    prompts = [p for chunk in iter_prompt_chunks(cfg, tokenizer, report, held_out=held_out)
               for p in chunk.prompts()]
    return prompts, report


def iter_prompt_chunks(cfg: DataConfig, tokenizer: Tokenizer, report: LoadReport, *,
                       held_out: bool = False, chunk_rows: int = CHUNK_ROWS
                       ) -> Iterator[PromptChunk]:
    """The data set's kept prompts in row order, ``chunk_rows`` rows read at a time; ``report``
    counts rows, kept prompts and skipped rows as they go (complete once the iterator is done).
    ValueError, naming the file and row, for a bad row under ``data.on_bad_row: error``, a
    column no record has, or a data set without a usable prompt."""
    path = cfg.eval_path if held_out else cfg.path
    if path is None or (held_out and cfg.eval_size == 0):
        return
    key = "data.eval_path" if held_out else "data.path"
    rows, source, columns_known = _read_rows(path, cfg, held_out=held_out, key=key)
    report.source = source
    limit = cfg.eval_size if held_out else None
    columns = _Columns(cfg, source, checked=columns_known)
    pending: list[tuple[int, int | None, str, str]] = []  # row, line, text, answer
    bad: list[tuple[int, int | None, BadRow]] = []  # skipped rows since the last flush

    def flush() -> PromptChunk:
        nonlocal pending, bad
        chunk = PromptChunk()
        ids = tokenize_prompts([text for _, _, text, _ in pending], cfg, tokenizer)
        for (i, line, text, answer), tok in zip(pending, ids):
            if len(tok) > cfg.max_prompt_tokens:
                bad.append((i, line, BadRow("prompt too long", f"prompt has {len(tok)} tokens, "
                                            f"over data.max_prompt_tokens={cfg.max_prompt_tokens}")))
                continue
            chunk.rows.append(i)
            chunk.texts.append(text)
            chunk.answers.append(answer)
            chunk.token_ids.append(tok)
        for i, line, e in sorted(bad, key=lambda b: b[0]):  # in row order, as they are numbered
            _bad_row(e, i, line, source, cfg, report, columns, rows)
        pending, bad = [], []
        report.num_kept += len(chunk)
        return chunk

    for i, (row, line) in enumerate(rows):
        report.num_rows += 1
        try:
            if isinstance(row, BadRow):
                raise row
            columns.add(row)
            text, answer = _check_row(row, cfg)
        except BadRow as e:
            bad.append((i, line, e))
            if cfg.on_bad_row == "error":
                flush()  # an earlier row may be too long: it is the one to name
            continue
        pending.append((i, line, text, answer))
        if limit is not None and report.num_kept + len(pending) >= limit:
            chunk = flush()
            yield chunk
            if report.num_kept >= limit:
                break
        elif len(pending) >= chunk_rows:
            yield flush()
    if pending or bad:
        yield flush()
    columns.check()
    if report.num_kept == 0:
        if report.num_rows == 0:
            raise ValueError(f"{key}: {source} has no rows")
        raise ValueError(f"{key}: {source}: no usable prompts ({report.summary()}; first: "
                         f"{report.examples[0] if report.examples else '-'})")


def _bad_row(e: BadRow, i: int, line: int | None, source: str, cfg: DataConfig,
             report: LoadReport, columns: _Columns, rest: Iterator) -> None:
    """Count a skipped row, or raise its error (``data.on_bad_row: error``): the column error
    instead when no record of the whole file has a field, since then the column name is wrong
    (the rest of the file is read for that, on this error path only)."""
    where = f"{source}: row {i}" + (f" (line {line})" if line is not None else "")
    if cfg.on_bad_row == "error":
        for row, _ in rest:
            if isinstance(row, dict):
                columns.add(row)
        columns.check()
        raise ValueError(f"{where}: {e} (set data.on_bad_row: skip to skip such rows)") from None
    report.skipped[e.reason] = report.skipped.get(e.reason, 0) + 1
    if len(report.examples) < _MAX_EXAMPLES:
        report.examples.append(f"{where}: {e}")


# A row as read: the record, or the reason it could not be read; and its line (JSON lines only).
_Row = tuple["dict | BadRow", "int | None"]
_FIELD_KEYS = ("data.prompt_field", "data.answer_field")


class _Columns:
    """Whether any record has the prompt and answer fields, and the keys of the first records: a
    field that no record has is a wrong column name (data.prompt_field/answer_field), not a file
    of bad rows. ``checked``: the reader knows its columns already (HF datasets)."""

    def __init__(self, cfg: DataConfig, source: str, checked: bool):
        self.names = (cfg.prompt_field, cfg.answer_field)
        self.source = source
        self.found = set(self.names) if checked else set()
        self.records = 0
        self.keys: dict[str, None] = {}

    def add(self, record: dict) -> None:
        self.records += 1
        if self.records <= 1000:
            self.keys.update(dict.fromkeys(record))
        if len(self.found) < 2:
            self.found.update(n for n in self.names if n in record)

    def check(self) -> None:
        if not self.records:
            return
        for name, field_key in zip(self.names, _FIELD_KEYS):
            if name not in self.found:
                raise ValueError(f"{self.source}: no column {name!r} ({field_key}); columns are "
                                 f"{list(self.keys)}")


def _read_rows(path: str, cfg: DataConfig, *, held_out: bool, key: str
               ) -> tuple[Iterator[_Row], str, bool]:
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
            raise ValueError(f"{key}: file not found: {path}")
        if local.stat().st_size == 0:
            raise ValueError(f"{key}: {path} is empty")
    elif local.exists():
        raise ValueError(f"{key}: {path} is not a .jsonl, .json or .parquet file")
    if local.suffix.lower() == ".jsonl":
        return _jsonl_rows(local), str(local), False
    import datasets  # heavy; only when a real dataset is read

    datasets.disable_progress_bars()
    if fmt is not None:
        try:
            ds = datasets.load_dataset(fmt, data_files=str(local), split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps every parse error; say where
            raise ValueError(f"{key}: cannot read {path}: {_utf8_problem(local) or e}") from e
        source = str(local)
    else:
        try:
            ds = datasets.load_dataset(path, split=cfg.split)
        except Exception as e:
            raise ValueError(f"{key}: {path!r} is neither a local file nor a loadable hub dataset "
                             f"(split {cfg.split!r}): {e}") from e
        source = path
    for name in (cfg.prompt_field, cfg.answer_field):
        if name not in ds.column_names:
            raise ValueError(f"{source}: no column {name!r} ({_FIELD_KEYS[name == cfg.answer_field]})"
                             f"; columns are {ds.column_names}")
    return _dataset_rows(ds.select_columns([cfg.prompt_field, cfg.answer_field])), source, True


def _dataset_rows(ds) -> Iterator[_Row]:
    """An HF dataset's rows, read from its memory-mapped Arrow cache a batch at a time."""
    for batch in ds.iter(batch_size=CHUNK_ROWS):
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            yield dict(zip(names, values)), None


def _jsonl_rows(path: Path) -> Iterator[_Row]:
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


def _check_row(row: dict, cfg: DataConfig) -> tuple[str, str]:
    """The row's prompt text and gold answer; ``BadRow`` naming what is wrong."""
    text = row.get(cfg.prompt_field)
    answer = row.get(cfg.answer_field)
    if text is None:
        raise BadRow("missing prompt", f"missing field {cfg.prompt_field!r}")
    if not isinstance(text, str):
        raise BadRow("wrong type", f"field {cfg.prompt_field!r} must be a string, got "
                                   f"{type(text).__name__}")
    if not text.strip():
        raise BadRow("empty prompt", f"field {cfg.prompt_field!r} is empty")
    if answer is None:
        raise BadRow("missing answer", f"missing field {cfg.answer_field!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow("wrong type", f"field {cfg.answer_field!r} must be a string or a number, got "
                                   f"{type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):  # parquet's and pandas' missing value
        raise BadRow("missing answer", f"field {cfg.answer_field!r} is {answer}, not an answer")
    answer = gold_answer(str(answer))
    if not answer:
        raise BadRow("empty answer", f"field {cfg.answer_field!r} is empty")
    return text, answer


def gold_answer(answer: str) -> str:
    """GSM8K-style answers carry their solution: keep what follows the last '####'."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def tokenize_prompt(text: str, cfg: DataConfig, tokenizer: Tokenizer) -> list[int]:
    """The token ids the engine is given: instruction appended, chat template applied."""
    return tokenize_prompts([text], cfg, tokenizer)[0]


def tokenize_prompts(texts: list[str], cfg: DataConfig, tokenizer: Tokenizer) -> list[list[int]]:
    """``tokenize_prompt`` of each text, in one tokenizer call (the same ids as one at a time)."""
    if not texts:
        return []
    contents = []
    for text in texts:
        content = cfg.prompt_template.replace("{prompt}", text)
        if cfg.instruction:
            content = f"{content.rstrip()}\n{cfg.instruction}"
        contents.append(content)
    ids_only = dict(return_attention_mask=False, return_token_type_ids=False)
    if not cfg.chat_template:
        return [list(ids) for ids in tokenizer(contents, **ids_only)["input_ids"]]
    rendered = []
    for content in contents:
        messages = [{"role": "user", "content": content}]
        if cfg.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        rendered.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True))
    return [list(ids) for ids in tokenizer(rendered, add_special_tokens=False,
                                           **ids_only)["input_ids"]]

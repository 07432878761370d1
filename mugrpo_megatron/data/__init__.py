"""Prompt datasets: local jsonl/json/parquet or hub ids through HF datasets, or the builtin task.

Rows are checked one by one; a malformed row (missing field, wrong type, empty answer, prompt over
``data.max_prompt_tokens`` after the chat template) stops loading with an error naming the file and
row, or, with ``data.on_bad_row: skip``, is skipped and counted in the ``LoadReport``.

The tokenizer is any Hugging Face tokenizer (``apply_chat_template`` and ``__call__``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

from mugrpo_megatron.config import DataConfig
from mugrpo_megatron.data.arithmetic import arithmetic_rows
from mugrpo_megatron.types import LoadReport, Prompt

BUILTIN_ARITHMETIC = "builtin:arithmetic"
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_MAX_EXAMPLES = 5


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


class BadRow(ValueError):
    """A row that cannot become a prompt; ``reason`` is short, for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def load_prompts(cfg: DataConfig, tokenizer: Tokenizer, *, held_out: bool = False
                 ) -> tuple[list[Prompt], LoadReport]:
    """The training prompts (or, with ``held_out``, the evaluation prompts), tokenized."""
    path = cfg.eval_path if held_out else cfg.path
    if path is None:
        return [], LoadReport(source="(none)")
    key = "data.eval_path" if held_out else "data.path"
    rows, source = _read_rows(path, cfg, held_out=held_out, key=key)
    report = LoadReport(source=source)
    prompts: list[Prompt] = []
    for i, (row, line) in enumerate(rows):
        report.num_rows += 1
        try:
            if isinstance(row, BadRow):
                raise row
            prompt = _make_prompt(i, row, cfg, tokenizer)
        except BadRow as e:
            where = f"{source}: row {i}" + (f" (line {line})" if line is not None else "")
            if cfg.on_bad_row == "error":
                raise ValueError(f"{where}: {e} (set data.on_bad_row: skip to skip such rows)") from None
            report.skipped[e.reason] = report.skipped.get(e.reason, 0) + 1
            if len(report.examples) < _MAX_EXAMPLES:
                report.examples.append(f"{where}: {e}")
            continue
        prompts.append(prompt)
        if held_out and len(prompts) == cfg.eval_size:
            break
    report.num_kept = len(prompts)
    if not prompts and not (held_out and cfg.eval_size == 0):
        if report.num_rows == 0:
            raise ValueError(f"{key}: {source} has no rows")
        raise ValueError(f"{key}: {source}: no usable prompts ({report.summary()}; first: "
                         f"{report.examples[0] if report.examples else '-'})")
    return prompts, report


# A row as read: the record, or the reason it could not be read; and its line (JSON lines only).
_Row = tuple["dict | BadRow", "int | None"]


def _read_rows(path: str, cfg: DataConfig, *, held_out: bool, key: str) -> tuple[list[_Row], str]:
    if path == BUILTIN_ARITHMETIC:
        train = arithmetic_rows(cfg.num_arithmetic_problems, max_operand=cfg.arithmetic_max_operand,
                                seed=cfg.seed)
        if not held_out:
            return [(r, None) for r in train], BUILTIN_ARITHMETIC
        exclude = frozenset(r["question"] for r in train)
        held = arithmetic_rows(cfg.eval_size, max_operand=cfg.arithmetic_max_operand,
                               seed=cfg.seed + 1_000_003, exclude=exclude)
        return [(r, None) for r in held], f"{BUILTIN_ARITHMETIC} (held out)"
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
        rows = _jsonl_rows(local)
        _check_fields([r for r, _ in rows if isinstance(r, dict)], cfg, str(local))
        return rows, str(local)
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
    return [(r, None) for r in ds.select_columns([cfg.prompt_field, cfg.answer_field]).to_list()], \
        source


_FIELD_KEYS = ("data.prompt_field", "data.answer_field")


def _jsonl_rows(path: Path) -> list[_Row]:
    """Every non-blank line of a JSON-lines file, parsed, with its line number.

    Written here rather than read through HF datasets, which stops at the first malformed line
    without naming it: a line that is not UTF-8, not JSON or not an object becomes a ``BadRow``
    for that line, so ``data.on_bad_row: skip`` skips it like any other bad row. One dict per
    row, as the prompts themselves are kept (10^6 prompts: a few seconds to read)."""
    rows: list[_Row] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                rows.append((BadRow("not UTF-8", f"not UTF-8 text (byte {e.start} of the line)"),
                             lineno))
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                rows.append((BadRow("invalid JSON", f"invalid JSON: {e.msg} (character {e.pos + 1})"),
                             lineno))
                continue
            if not isinstance(obj, dict):
                rows.append((BadRow("not an object",
                                    f"expected a JSON object, got {type(obj).__name__}"), lineno))
                continue
            rows.append((obj, lineno))
    return rows


def _check_fields(records: list[dict], cfg: DataConfig, source: str) -> None:
    """A field that no record has is a wrong column name (data.prompt_field/answer_field), not a
    file of bad rows."""
    if not records:
        return
    for name, field_key in zip((cfg.prompt_field, cfg.answer_field), _FIELD_KEYS):
        if not any(name in r for r in records):
            seen = list(dict.fromkeys(k for r in records[:1000] for k in r))
            raise ValueError(f"{source}: no column {name!r} ({field_key}); columns are {seen}")


def _utf8_problem(path: Path) -> str:
    """Where a file stops being UTF-8 text ('' if it is)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"not UTF-8 text at line {line} (byte {e.start})"
    return ""


def _make_prompt(index: int, row: dict, cfg: DataConfig, tokenizer: Tokenizer) -> Prompt:
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
    token_ids = tokenize_prompt(text, cfg, tokenizer)
    if len(token_ids) > cfg.max_prompt_tokens:
        raise BadRow("prompt too long", f"prompt has {len(token_ids)} tokens, over "
                                        f"data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return Prompt(index=index, text=text, answer=answer, token_ids=tuple(token_ids))


def gold_answer(answer: str) -> str:
    """GSM8K-style answers carry their solution: keep what follows the last '####'."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def tokenize_prompt(text: str, cfg: DataConfig, tokenizer: Tokenizer) -> list[int]:
    """The token ids the engine is given: instruction appended, chat template applied."""
    content = cfg.prompt_template.replace("{prompt}", text)
    if cfg.instruction:
        content = f"{content.rstrip()}\n{cfg.instruction}"
    if cfg.chat_template:
        messages = [{"role": "user", "content": content}]
        if cfg.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(content)["input_ids"])

"""Prompt datasets: local jsonl/json/parquet or hub ids through HF datasets, or the builtin task;
one file, a mixture of several (``data.path`` a list), or named held-out sets.

Rows are read as a stream (``readers``: a JSON-lines file line by line, parquet/json and hub
datasets from HF datasets' Arrow cache a batch at a time), checked one by one and tokenized a
chunk at a time in one tokenizer call (``iter_prompt_chunks``): nothing here holds the whole
data set, so memory does not grow with it. ``load_prompts`` collects the chunks into ``Prompt``
objects (the held-out sets, the eval command); the trainer writes them to a columnar file
instead (``prompt_store``).

A row's prompt is a string or a list of ``{role, content}`` chat messages (verl's parquet layout,
HF chat datasets); field names may be dotted paths into nested columns (``reward_model.
ground_truth``). Each prompt keeps its source (``data.source_field``, else its file's stem) and
the row's ``data.metadata_fields`` as JSON, for rewards that read them.

A malformed row (missing field, wrong type, empty answer, a message that is not a ``{role,
content}`` pair of strings or has an unknown role, prompt over ``data.max_prompt_tokens`` after
the chat template) stops loading with an error naming the file, row and field, or, with
``data.on_bad_row: skip``, is skipped and counted in the ``LoadReport``.

The tokenizer is any Hugging Face tokenizer (``apply_chat_template`` and ``__call__``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mugrpo_megatron.config import DataConfig
from mugrpo_megatron.config.run import MESSAGE_ROLES, source_name
from mugrpo_megatron.data.readers import (
    CHUNK_ROWS,
    BadRow,
    read_rows,
    required_fields,
)
from mugrpo_megatron.types import LoadReport, Prompt

_MAX_EXAMPLES = 5
_MISSING = object()


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def __call__(self, text: str | list[str], **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class RowFields:
    """What a checked row gives: its prompt (text or messages), answer, source and metadata."""

    prompt: str | list[dict[str, str]]
    answer: str
    source: str
    metadata: str
    """The row's ``data.metadata_fields`` as a JSON object, '' without any."""


@dataclass
class PromptChunk:
    """Consecutive kept prompts, column by column."""

    rows: list[int] = field(default_factory=list)
    """Row of the source data set of each prompt (0-based)."""
    texts: list[str] = field(default_factory=list)
    """Each prompt as rendered: the text its token ids are (chat template applied)."""
    answers: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def prompts(self) -> list[Prompt]:
        return [Prompt(index=i, text=t, answer=a, token_ids=tuple(ids), source=s, metadata=m)
                for i, t, a, ids, s, m in zip(self.rows, self.texts, self.answers,
                                              self.token_ids, self.sources, self.metadata)]


def load_prompts(cfg: DataConfig, tokenizer: Tokenizer, *, held_out: bool = False
                 ) -> tuple[list[Prompt], LoadReport]:
    """The training prompts of every ``data.path`` (or, with ``held_out``, of the one held-out
    set: ``load_eval_sets`` reads several), tokenized, as Python objects (~40 bytes a token: for
    sets of thousands, not a training set of millions; the trainer maps those,
    ``prompt_store``). One report for all files (``LoadReport.files`` has each)."""
    if held_out:
        sets = load_eval_sets(cfg, tokenizer)
        if len(sets) > 1:
            raise ValueError(f"data.eval_path: {len(sets)} held-out sets; load them with "
                             f"load_eval_sets")
        return next(iter(sets.values()), ([], LoadReport(source="(none)")))
    prompts, total = [], LoadReport(source=", ".join(cfg.paths))
    for path in cfg.paths:
        report = LoadReport(source="(none)")
        prompts += [p for chunk in iter_prompt_chunks(cfg, tokenizer, report, path=path)
                    for p in chunk.prompts()]
        total.add(report)
    return prompts, total


def load_eval_sets(cfg: DataConfig, tokenizer: Tokenizer
                   ) -> dict[str, tuple[list[Prompt], LoadReport]]:
    """Each named held-out set's first ``data.eval_size`` prompts and its report
    (``data.eval_sets``); empty without ``data.eval_path`` or with ``data.eval_size`` 0."""
    out = {}
    for name, path in cfg.eval_sets.items():
        report = LoadReport(source="(none)")
        chunks = iter_prompt_chunks(cfg, tokenizer, report, held_out=True, path=path,
                                    key=f"data.eval_path.{name}" if isinstance(cfg.eval_path, dict)
                                    else "data.eval_path")
        prompts = [p for chunk in chunks for p in chunk.prompts()]
        if prompts:
            out[name] = (prompts, report)
    return out


def iter_prompt_chunks(cfg: DataConfig, tokenizer: Tokenizer | None, report: LoadReport, *,
                       held_out: bool = False, path: str | None = None, key: str | None = None,
                       chunk_rows: int = CHUNK_ROWS, tokenize_rows: int | None = None
                       ) -> Iterator[PromptChunk]:
    """The kept prompts of ``path`` (default: the only ``data.path``) in row order,
    ``chunk_rows`` rows read at a time; with ``held_out`` its first ``data.eval_size``, the
    builtin task's held-out draw. ``report`` counts rows, kept prompts and skipped rows as they
    go (complete once the iterator is done). ValueError, naming the file, row and field, for a
    bad row under ``data.on_bad_row: error``, a column no record has, or a data set without a
    usable prompt; ``key`` names the setting in messages.

    Without a ``tokenizer``, and past the first ``tokenize_rows`` kept rows, rows are checked as
    above but not rendered: their chunks hold no texts or token ids and their prompt length is
    not checked (the checks before a run: ``inputs.check_inputs``)."""
    if path is None:
        if len(cfg.paths) != 1:
            raise ValueError("iter_prompt_chunks reads one path at a time (data.path is a list)")
        path = cfg.paths[0]
    if held_out and cfg.eval_size == 0:
        return
    key = key or ("data.eval_path" if held_out else "data.path")
    rows, source, columns_known = read_rows(path, cfg, held_out=held_out, key=key)
    report.source = source
    stem = source_name(path)
    limit = cfg.eval_size if held_out else None
    columns = _Columns(cfg, source, checked=columns_known)
    pending: list[tuple[int, int | None, RowFields]] = []  # row, line, its fields
    bad: list[tuple[int, int | None, BadRow]] = []  # skipped rows since the last flush

    def flush() -> PromptChunk:
        nonlocal pending, bad
        chunk = PromptChunk()
        render = tokenizer is not None and (tokenize_rows is None
                                            or report.num_kept < tokenize_rows)
        texts, ids = (render_prompts([f.prompt for _, _, f in pending], cfg, tokenizer) if render
                      else ([None] * len(pending), [None] * len(pending)))
        for (i, line, f), text, tok in zip(pending, texts, ids):
            if tok is not None and len(tok) > cfg.max_prompt_tokens:
                bad.append((i, line, BadRow("prompt too long", f"prompt has {len(tok)} tokens, "
                                            f"over data.max_prompt_tokens={cfg.max_prompt_tokens}")))
                continue
            chunk.rows.append(i)
            if tok is not None:
                chunk.texts.append(text)
                chunk.token_ids.append(tok)
            chunk.answers.append(f.answer)
            chunk.sources.append(f.source)
            chunk.metadata.append(f.metadata)
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
            fields = check_row(row, cfg, stem)
        except BadRow as e:
            bad.append((i, line, e))
            if cfg.on_bad_row == "error":
                flush()  # an earlier row may be too long: it is the one to name
            continue
        pending.append((i, line, fields))
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


def dotted(row: dict, name: str) -> Any:
    """``row``'s field ``name``: a column of that name, else a dotted path into nested ones
    (``reward_model.ground_truth``); ``_MISSING`` where there is none."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


class _Columns:
    """Whether any record has each required field, and the keys of the first records: a field
    that no record has is a wrong column name (data.prompt_field, answer_field,
    metadata_fields), not a file of bad rows. ``checked``: the reader knows its columns already
    (HF datasets)."""

    def __init__(self, cfg: DataConfig, source: str, checked: bool):
        self.names = required_fields(cfg)
        self.source = source
        self.found = set(self.names.values()) if checked else set()
        self.records = 0
        self.keys: dict[str, None] = {}

    def add(self, record: dict) -> None:
        self.records += 1
        if self.records <= 1000:
            self.keys.update(dict.fromkeys(record))
        if len(self.found) < len(self.names):
            self.found.update(n for n in self.names.values() if dotted(record, n) is not _MISSING)

    def check(self) -> None:
        if not self.records:
            return
        for key, name in self.names.items():
            if name not in self.found:
                raise ValueError(f"{self.source}: no column {name!r} ({key}); columns are "
                                 f"{list(self.keys)}")


def check_row(row: dict, cfg: DataConfig, stem: str) -> RowFields:
    """The row's prompt, gold answer, source (``stem`` where it has none) and metadata;
    ``BadRow`` naming the field and what is wrong."""
    prompt = dotted(row, cfg.prompt_field)
    if prompt is _MISSING or prompt is None:
        raise BadRow("missing prompt", f"missing field {cfg.prompt_field!r}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("empty prompt", f"field {cfg.prompt_field!r} is empty")
    elif isinstance(prompt, (list, tuple)):
        prompt = _check_messages(prompt, cfg)
    else:
        raise BadRow("wrong type", f"field {cfg.prompt_field!r} must be a string or a list of "
                                   f"{{role, content}} messages, got {type(prompt).__name__}")
    answer = dotted(row, cfg.answer_field)
    if answer is _MISSING or answer is None:
        raise BadRow("missing answer", f"missing field {cfg.answer_field!r}")
    if isinstance(answer, dict):  # a struct (verl's code sets: test cases as an object): JSON
        try:
            answer = json.dumps(answer)
        except (TypeError, ValueError) as e:
            raise BadRow("wrong type", f"field {cfg.answer_field!r} is a struct that is not "
                                       f"JSON data ({e})") from None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BadRow("wrong type", f"field {cfg.answer_field!r} must be a string, a number or a "
                                   f"struct (JSON test cases), got {type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):  # parquet's and pandas' missing value
        raise BadRow("missing answer", f"field {cfg.answer_field!r} is {answer}, not an answer")
    answer = gold_answer(str(answer))
    if not answer:
        raise BadRow("empty answer", f"field {cfg.answer_field!r} is empty")
    source = dotted(row, cfg.source_field)
    if source is _MISSING or source is None:
        source = stem
    elif not isinstance(source, str) or not source:
        raise BadRow("wrong type", f"field {cfg.source_field!r} (data.source_field) must be a "
                                   f"non-empty string, got {source!r}")
    meta = {}
    for name in cfg.metadata_fields:
        value = dotted(row, name)
        if value is _MISSING:
            raise BadRow("missing metadata", f"missing field {name!r} (data.metadata_fields)")
        meta[name] = value
    try:
        metadata = json.dumps(meta, ensure_ascii=False, allow_nan=False) if meta else ""
    except (TypeError, ValueError) as e:
        raise BadRow("wrong type", f"data.metadata_fields: a value is not JSON ({e})") from None
    return RowFields(prompt, answer, source, metadata)


def _check_messages(messages, cfg: DataConfig) -> list[dict[str, str]]:
    """A message prompt as {role, content} pairs of strings (extra keys that hold nothing, as a
    parquet struct column gives them, dropped); ``BadRow`` naming the message."""
    name = cfg.prompt_field
    if not cfg.chat_template:
        raise BadRow("messages without template", f"field {name!r} holds chat messages, which "
                                                  f"need the chat template (data.chat_template: "
                                                  f"true)")
    if not messages:
        raise BadRow("empty prompt", f"field {name!r} is an empty list of messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str) or \
                any(v is not None for key, v in m.items() if key not in ("role", "content")):
            raise BadRow("bad message", f"field {name!r}, message {k}: expected a {{role, "
                                        f"content}} pair of strings, got {str(m)[:100]!r}")
        if m["role"] not in MESSAGE_ROLES:
            raise BadRow("bad message", f"field {name!r}, message {k}: unknown role "
                                        f"{m['role']!r} (one of {', '.join(MESSAGE_ROLES)})")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise BadRow("bad message", f"field {name!r}: no user message")
    return out


def gold_answer(answer: str) -> str:
    """GSM8K-style answers carry their solution: keep what follows the last '####'."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def tokenize_prompt(text: str, cfg: DataConfig, tokenizer: Tokenizer) -> list[int]:
    """The token ids the engine is given: instruction appended, chat template applied."""
    return tokenize_prompts([text], cfg, tokenizer)[0]


def tokenize_prompts(prompts: list, cfg: DataConfig, tokenizer: Tokenizer) -> list[list[int]]:
    """``tokenize_prompt`` of each prompt, in one tokenizer call (the same ids as one at a time)."""
    return render_prompts(prompts, cfg, tokenizer)[1]


def render_prompts(prompts: list, cfg: DataConfig, tokenizer: Tokenizer
                   ) -> tuple[list[str], list[list[int]]]:
    """Each prompt (a string, or chat messages) as the engine is given it: as text, and as token
    ids, in one tokenizer call. A string is put into ``data.prompt_template`` with
    ``data.instruction`` after it, and (with the chat template) made one user message; messages
    get ``data.instruction`` appended to their last user message and ``data.system_prompt``
    where they have no system message. The chat template is applied with
    ``data.chat_template_kwargs``."""
    if not prompts:
        return [], []
    conversations = []
    for prompt in prompts:
        if isinstance(prompt, str):
            content = cfg.prompt_template.replace("{prompt}", prompt)
            if cfg.instruction:
                content = f"{content.rstrip()}\n{cfg.instruction}"
            conversations.append(content if not cfg.chat_template
                                 else [{"role": "user", "content": content}])
            continue
        messages = [dict(m) for m in prompt]
        if cfg.instruction:
            last = max(k for k, m in enumerate(messages) if m["role"] == "user")
            messages[last] = replace_content(messages[last], cfg.instruction)
        conversations.append(messages)
    ids_only = dict(return_attention_mask=False, return_token_type_ids=False)
    if not cfg.chat_template:
        return conversations, [list(ids) for ids in tokenizer(conversations, **ids_only)["input_ids"]]
    rendered = []
    for messages in conversations:
        if cfg.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        rendered.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True,
                                                      **cfg.chat_template_kwargs))
    return rendered, [list(ids) for ids in tokenizer(rendered, add_special_tokens=False,
                                                     **ids_only)["input_ids"]]


def replace_content(message: dict[str, str], instruction: str) -> dict[str, str]:
    """``message`` with ``instruction`` appended to its content, on a line of its own."""
    return {**message, "content": f"{message['content'].rstrip()}\n{instruction}"}


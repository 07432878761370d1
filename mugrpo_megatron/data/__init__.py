"""Prompt datasets: local jsonl/json/parquet or hub ids through HF datasets, or the builtin task.

Rows are checked one by one; a malformed row (missing field, wrong type, empty answer, prompt over
``data.max_prompt_tokens`` after the chat template) stops loading with an error naming the file and
row, or, with ``data.on_bad_row: skip``, is skipped and counted in the ``LoadReport``.

The tokenizer is any Hugging Face tokenizer (``apply_chat_template`` and ``__call__``).
"""

from __future__ import annotations

import json
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
    for i, row in enumerate(rows):
        report.num_rows += 1
        try:
            prompt = _make_prompt(i, row, cfg, tokenizer)
        except BadRow as e:
            where = f"{source}: row {i}" + (f" (line {i + 1})" if source.endswith(".jsonl") else "")
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
        raise ValueError(f"{source}: no usable prompts ({report.summary()})")
    return prompts, report


def _read_rows(path: str, cfg: DataConfig, *, held_out: bool, key: str) -> tuple[list[dict], str]:
    if path == BUILTIN_ARITHMETIC:
        train = arithmetic_rows(cfg.num_arithmetic_problems, max_operand=cfg.arithmetic_max_operand,
                                seed=cfg.seed)
        if not held_out:
            return train, BUILTIN_ARITHMETIC
        exclude = frozenset(r["question"] for r in train)
        return (arithmetic_rows(cfg.eval_size, max_operand=cfg.arithmetic_max_operand,
                                seed=cfg.seed + 1_000_003, exclude=exclude),
                f"{BUILTIN_ARITHMETIC} (held out)")
    import datasets  # heavy; only when a real dataset is read

    datasets.disable_progress_bars()
    local = Path(path)
    fmt = _FILE_FORMATS.get(local.suffix.lower())
    if fmt is not None:
        if not local.is_file():
            raise ValueError(f"{key}: file not found: {path}")
        try:
            ds = datasets.load_dataset(fmt, data_files=str(local), split="train")
        except Exception as e:  # datasets wraps parse errors; find the line ourselves for jsonl
            if fmt == "json":
                _raise_on_bad_json_line(local)
            raise ValueError(f"{key}: cannot read {path}: {e}") from e
        source = str(local)
    elif local.exists():
        raise ValueError(f"{key}: {path} is not a .jsonl, .json or .parquet file")
    else:
        try:
            ds = datasets.load_dataset(path, split=cfg.split)
        except Exception as e:
            raise ValueError(f"{key}: {path!r} is neither a local file nor a loadable hub dataset "
                             f"(split {cfg.split!r}): {e}") from e
        source = path
    for name in (cfg.prompt_field, cfg.answer_field):
        if name not in ds.column_names:
            field_key = "data.prompt_field" if name == cfg.prompt_field else "data.answer_field"
            raise ValueError(f"{source}: no column {name!r} ({field_key}); columns are "
                             f"{ds.column_names}")
    return ds.select_columns([cfg.prompt_field, cfg.answer_field]).to_list(), source


def _raise_on_bad_json_line(path: Path) -> None:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object, got "
                                 f"{type(obj).__name__}")


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

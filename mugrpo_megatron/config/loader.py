"""Loading a run configuration: YAML files and ``--set key.sub=value`` overrides into the frozen
dataclasses of ``config``, with every type and key checked and named; and the way back (plain
data, YAML, a described listing of every key).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mugrpo_megatron.config import Config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a Config from a YAML file (or the defaults) and ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ValueError(f"--config: {path}: " + ("is a directory, not a YAML file"
                             if Path(path).is_dir() else "no such file"))
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): is it a YAML file?") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}: line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
            what = getattr(e, "problem", None) or str(e)
            raise ValueError(f"{where}: not valid YAML: {what}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set algo.clip_high=4.0")
        _set_dotted(raw, key.strip(), _parse_value(value))
    return from_dict(Config, raw, prefix="")


def _parse_value(text: str) -> Any:
    """A scalar from YAML (numbers, true/false, null); text that YAML reads as a mapping or list
    ("Example: 2 + 3") is kept as the string it is here, and read as YAML again only by a key
    whose type is a list or mapping (``--set data.path=[a.parquet,b.parquet]``)."""
    if not text.strip():
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, (dict, list)) else value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {key}: {'.'.join(parents[:i + 1])} is not a section")
        node = child
    node[leaf] = value


RENAMED = {"model.recompute_activations": "model.recompute: none, selective or full (true was "
                                          "full, false none)",
           "algo.drop_uniform_groups": "algo.uniform_groups: keep, drop or drop_once (true was "
                                       "drop, false keep)",
           "rollout.eval_samples": "eval.samples (the held-out sets' sampling is in the eval "
                                   "section: samples, temperature, top_p, max_new_tokens, "
                                   "pass_k)"}
"""Keys of earlier releases, and what a config now says instead."""
PEER_NAMES = {
    "rollout.tool_config_path": "rollout.tools, a list of 'python' (the model's code run in "
                                "reward.sandbox; verl's SandboxFusionTool) or 'module:function' "
                                "(a function's docstring is its schema, or its tool_schema "
                                "attribute)",
    "rollout.multi_turn": "rollout.tools, rollout.max_turns, rollout.max_tool_calls_per_turn, "
                          "rollout.tool_output_chars and rollout.tool_format (no section)",
    "rollout.max_assistant_turns": "rollout.max_turns",
    "rollout.max_parallel_calls": "rollout.max_tool_calls_per_turn",
    "rollout.max_tool_response_length": "rollout.tool_output_chars (characters, its middle cut)",
    "rollout.tool_response_truncate_side": "rollout.tool_output_chars, which keeps both ends "
                                           "(verl's 'middle')",
    "rollout.format": "rollout.tool_format",
    "data.apply_chat_template_kwargs": "data.chat_template_kwargs",
    "logging.validation_data_dir": "logging.eval_samples ('ends' or 'all': under run_dir/eval)",
}
"""verl's names for keys this config has under another name (README, 'Coming from verl')."""


def from_dict(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and types; errors name the dotted key."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if f"{prefix}{key}" in RENAMED:
            raise ValueError(f"{prefix}{key}: replaced by {RENAMED[f'{prefix}{key}']}")
        if f"{prefix}{key}" in PEER_NAMES and key not in names:
            raise ValueError(f"{prefix}{key}: verl's name; here it is "
                             f"{PEER_NAMES[f'{prefix}{key}']}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else f"; known keys: {', '.join(names)}"
            raise ValueError(f"{prefix}{key}: unknown key{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def _as_container(value: Any, kind: type, key: str) -> Any:
    """A list or mapping for a key of that type: as YAML gave it, or YAML in a string (an
    override on the command line)."""
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, kind):
            return parsed
    if not isinstance(value, kind):
        what = "a list, e.g. [a, b]" if kind is list else "a mapping, e.g. {key: value}"
        raise ValueError(f"{key}: must be {what}, got {value!r}")
    return value


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:  # a JSON scalar (template options): what YAML gave, if it is one
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"{key}: must be a string, number, true/false, got {value!r}")
        return value
    if origin is tuple:  # tuple[X, ...]: a list of X
        items = _as_container(value, list, key)
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(items))
    if origin is dict:  # dict[str, X]
        items = _as_container(value, dict, key)
        out = {}
        for k, v in items.items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"{key}: keys must be non-empty strings, got {k!r}")
            out[k] = _coerce(v, args[1], f"{key}.{k}")
        return out
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and any(typing.get_origin(a) in (tuple, dict) for a in args):
            try:  # an override's list or mapping, as YAML ("[a.parquet, b.parquet]")
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = None
            if isinstance(parsed, (list, dict)):
                value = parsed
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{key}: must be one of {list(args)}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
        return value
    if tp is float:
        number = value
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"{key}: must be a number, got {value!r}")
        if not math.isfinite(number):  # no setting means "unbounded" by inf, nor anything by nan
            raise ValueError(f"{key}: must be a finite number, got {value!r}")
        return float(number)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {tp}")  # a bug in this module, not user input


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (for YAML dumps and run records): lists for tuples, as YAML and
    JSON read them back."""
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def describe(cfg: Config | None = None) -> str:
    """Every key with its value and docstring, for the ``config`` command."""
    cfg = cfg or Config()
    lines = []
    top_docs = field_docs(Config)
    for section in dataclasses.fields(Config):
        sub = getattr(cfg, section.name)
        lines.append(f"{section.name}:  # {top_docs[section.name]}")
        docs = field_docs(type(sub))
        for f in dataclasses.fields(sub):
            doc = " ".join(docs[f.name].split())
            lines.append(f"  {f.name}: {getattr(sub, f.name)!r}\n      {doc}")
    return "\n".join(lines)


def dump_yaml(cfg: Config) -> str:
    """``cfg`` as YAML that ``load_config`` reads back to ``cfg`` (a run's ``config.yaml``): the
    tools' schemas the config puts into data.chat_template_kwargs from rollout.tools are left
    out (no YAML key takes them) and made again as it loads."""
    data = to_dict(cfg)
    if cfg.rollout.tools:
        data["data"]["chat_template_kwargs"].pop("tools", None)
    return yaml.safe_dump(data, sort_keys=False)

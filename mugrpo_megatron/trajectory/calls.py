"""Tool calls parsed from a model turn's text, in the call formats of the families we support
(vLLM's ``--tool-call-parser`` names):

- ``hermes`` (Qwen2.5, Qwen3, and the Hermes models): each call a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; any number
  a turn, with text around them.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn is the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``; several separated by ``;``.

A call the model made but that cannot be used (not JSON, no name, arguments that are not an
object, an unclosed tag) is still a call: it comes back as ``ToolCall`` with ``error`` set, and
the model is told so in the tool's message. Plain text is no call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALL_FORMATS: tuple[str, ...] = ("auto", "hermes", "llama3_json")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool by the model."""

    name: str
    """The tool's name ('' where the call named none)."""
    arguments: dict = field(default_factory=dict)
    error: str = ""
    """Why the call cannot be run ('' for a well-formed call; the tool may still be unknown)."""


def call_format(chat_template: str | None, wanted: str = "auto") -> str:
    """The format a model's calls are parsed in: ``wanted``, or with 'auto' the one its chat
    template renders tool calls in (``<tool_call>``: hermes; Llama 3.1's ``ipython`` role or
    ``<|python_tag|>``: llama3_json; hermes otherwise)."""
    if wanted not in CALL_FORMATS:
        raise ValueError(f"rollout.tool_format must be one of {CALL_FORMATS}, got {wanted!r}")
    if wanted != "auto":
        return wanted
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or _PYTHON_TAG in template:
        return "llama3_json"
    return "hermes"


def parse_calls(text: str, fmt: str) -> list[ToolCall]:
    """The calls in one model turn's ``text`` (decoded with its special tokens: the python tag
    and the call tags are matched as text), in order."""
    if fmt == "hermes":
        return [_call(body.strip(), "arguments", closed=bool(end))
                for body, end in _HERMES.findall(text)]
    if fmt == "llama3_json":
        body = text.strip()
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        tagged = body.startswith(_PYTHON_TAG)
        body = body.removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return [ToolCall("", error="the python tag was not followed by a JSON call")] \
                if tagged else []
        return [_call(part, "parameters") for part in _split_objects(body)]
    raise ValueError(f"unknown tool call format {fmt!r} (one of {CALL_FORMATS[1:]})")


def _split_objects(body: str) -> list[str]:
    """``{...}; {...}`` as its objects' texts (a part that is not JSON stays whole: an error)."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            parts.append(body[at:])
            break
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return parts


def _call(body: str, key: str, closed: bool = True) -> ToolCall:
    if not closed:
        return ToolCall("", error="a <tool_call> was not closed with </tool_call>")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='the call is not a JSON object with a "name"')
    args = obj.get(key, obj.get("arguments" if key != "arguments" else "parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error=f'"{key}" is a string that is not JSON')
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f'"{key}" must be a JSON object, got '
                                           f'{type(args).__name__}')
    return ToolCall(obj["name"], args)

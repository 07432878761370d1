"""Tool calls parsed from a model turn's text, in the call formats of the families we support
(vLLM's ``--tool-call-parser`` names):

- ``hermes`` (Qwen2.5, Qwen3, and the Hermes models): each call a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; any number
  a turn, with text around them.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn is the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``; several separated by ``;``.

A call the model made but that cannot be used (not JSON, no name, arguments that are not an
object, nested deeper than ``MAX_DEPTH``, an unclosed tag) is still a call: it comes back as
``ToolCall`` with ``error`` set, and the model is told so in the tool's message. Plain text is no
call. Nothing a model writes makes the parser raise: a turn is whatever the policy sampled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALL_FORMATS: tuple[str, ...] = ("auto", "hermes", "llama3_json")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
MAX_DEPTH = 32
"""Arguments nested deeper than this are refused as a malformed call (Python's JSON reader
recurses a level a frame: a call nested ~1,000 deep raised RecursionError out of a turn)."""


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


def capped(calls: list[ToolCall], most: int) -> tuple[list[ToolCall], int]:
    """A turn's calls as they are run: its first ``most``, then, where it made more, one
    malformed call whose error tells the model the others were not run; and how many those
    were (``rollout.max_tool_calls_per_turn``)."""
    over = len(calls) - most
    if over <= 0:
        return calls, 0
    note = ToolCall(calls[most].name, error=f"{over} more call(s) in this turn were not run: at "
                                            f"most {most} a turn (rollout.max_tool_calls_per_turn)")
    return calls[:most] + [note], over


def _split_objects(body: str) -> list[str]:
    """``{...}; {...}`` as its objects' texts (a part that is not JSON stays whole: an error)."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    if _depth(body) > MAX_DEPTH:
        return [body]  # one malformed call: _call says why
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except (json.JSONDecodeError, RecursionError, ValueError):
            parts.append(body[at:])
            break
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return parts


def _depth(body: str) -> int:
    """How deep JSON text nests its objects and arrays, strings skipped (no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in body:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _call(body: str, key: str, closed: bool = True) -> ToolCall:
    if not closed:
        return ToolCall("", error="a <tool_call> was not closed with </tool_call>")
    if _depth(body) > MAX_DEPTH:
        return ToolCall("", error=f"the call nests its JSON deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the call is not valid JSON ({e.msg} at character {e.pos})")
    except (RecursionError, ValueError) as e:  # what MAX_DEPTH's count may miss: not a call
        return ToolCall("", error=f"the call cannot be read as JSON ({type(e).__name__})")
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

"""The tools a policy may call (``rollout.tools``) and the pool of worker processes that runs
them while the engine goes on decoding.

A tool is the built-in ``python`` or a ``module:function`` path (as rewards are named). The
built-in runs the model's code in the code reward's sandbox (``rewards.sandbox``: the same
``reward.sandbox*`` limits, checked at start as ``score`` checks them) and answers with what the
program printed, its traceback included, and the value of a last bare expression as a notebook
shows it (ToRL, ReTool and SimpleTIR run code that way). A user's function is called with the
call's arguments by name, plus, where it takes them, the row's ``tools_kwargs`` (verl's
``extra_info.tools_kwargs[name]``: its ``create_kwargs`` and ``execute_kwargs``); it returns the
message text (anything else is shown as JSON). Its JSON schema, which the chat template shows
the model, is its ``tool_schema`` attribute where it has one, else read from its signature and
Google-style docstring by transformers' ``get_json_schema`` (what ``apply_chat_template`` does
with a function given as a tool).

Every call runs in a worker of a ``pebble`` process pool (``rollout.tool_workers`` of them, one
call at a time each: the sandbox bounds one run a process), under ``rollout.tool_timeout_s`` of
wall clock, after which the worker is killed and replaced. An unknown tool, arguments the schema
does not allow, a function that raises or overruns: the model gets an error message, the call
is counted as failed, nothing stops. Output is cut to ``rollout.tool_output_chars``, keeping its
beginning and end (verl's ``max_tool_response_length`` with ``tool_response_truncate_side:
middle``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import multiprocessing
import os
from concurrent.futures import Future
from dataclasses import dataclass

from mugrpo_megatron.procs import die_with_parent
from mugrpo_megatron.rewards.sandbox_spec import SandboxSpec
from mugrpo_megatron.trajectory.calls import ToolCall

PYTHON = "python"
PYTHON_SCHEMA = {"type": "function", "function": {
    "name": PYTHON,
    "description": "Run Python 3 code in a fresh sandbox (no network, no files kept between "
                   "calls) and return what it prints; the value of a last bare expression is "
                   "shown too.",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "The Python program to run."}},
        "required": ["code"]}}}

_NOTEBOOK = '''import ast, linecache, os, sys, traceback
sys.stderr = sys.stdout
here = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(here, "code.py")
if not os.path.exists(path):  # a service that writes the files where it runs, not beside it
    path = "code.py"
source = open(path).read()
linecache.cache["code.py"] = (len(source), None, source.splitlines(True), "code.py")
try:
    tree = ast.parse(source, "code.py")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    scope = {"__name__": "__main__"}
    exec(compile(tree, "code.py", "exec"), scope)
    if last is not None:
        value = eval(compile(last, "code.py", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as e:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "code.py":
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
    sys.exit(1)
'''
"""The program the python tool runs: the model's code (``code.py`` beside it: the sandbox's
``/sandbox``, an unsafe run's directory, or a SandboxFusion service's working directory) as a
notebook cell, errors to stdout (the sandbox keeps stdout only), a traceback from the model's
code down, its lines shown, the harness's frames left out."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the workers call it."""

    name: str
    path: str
    """``module:function``, or 'python' for the built-in."""
    schema: dict
    """The OpenAI function schema the chat template is given (``{"type": "function", ...}``)."""
    takes_row: frozenset[str] = frozenset()
    """Which of ``create_kwargs``/``execute_kwargs``-given names the function takes by name."""

    @property
    def required(self) -> list[str]:
        return list(self.schema["function"].get("parameters", {}).get("required", []))

    @property
    def allowed(self) -> set[str] | None:
        """The argument names the schema lists (None: any)."""
        props = self.schema["function"].get("parameters", {}).get("properties")
        return set(props) if isinstance(props, dict) else None


def _import(path: str, key: str):
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is neither the built-in {PYTHON!r} nor a "
                         f"'module:function' path")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot import {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is not callable")
    return fn


ROW_KWARGS = ("create_kwargs", "execute_kwargs")
"""What a user's tool may take of its row (verl's ``tools_kwargs[name]``), never the model."""


def _without_row(fn):
    """``fn`` as the model sees it: its signature and annotations without ``ROW_KWARGS`` (for
    ``get_json_schema``, which describes every parameter)."""
    sig = inspect.signature(fn)

    def shown(*args, **kwargs):
        return fn(*args, **kwargs)

    shown.__name__, shown.__doc__ = fn.__name__, fn.__doc__
    shown.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values()
                                                  if p.name not in ROW_KWARGS])
    shown.__annotations__ = {k: v for k, v in getattr(fn, "__annotations__", {}).items()
                             if k not in ROW_KWARGS}
    return shown


def resolve_tools(names: tuple[str, ...]) -> list[ToolSpec]:
    """Each of ``rollout.tools`` as a ``ToolSpec``, imported and its schema read here, in the
    parent, so that a bad one stops the run before it starts; ValueError naming the entry."""
    specs: list[ToolSpec] = []
    for k, path in enumerate(names):
        key = f"rollout.tools[{k}]"
        if path == PYTHON:
            specs.append(ToolSpec(PYTHON, PYTHON, PYTHON_SCHEMA))
            continue
        fn = _import(path, key)
        schema = getattr(fn, "tool_schema", None)
        if schema is None:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(_without_row(fn))
            except Exception as e:  # noqa: BLE001 - transformers' own DocstringParsingException
                raise ValueError(f"{key}: {path!r} has no tool_schema attribute and its JSON "
                                 f"schema cannot be read from its signature and docstring "
                                 f"({e})") from e
        if "function" not in schema:
            schema = {"type": "function", "function": schema}
        if not schema["function"].get("name"):
            raise ValueError(f"{key}: {path!r}'s schema has no function name")
        params = inspect.signature(fn).parameters
        takes = frozenset(p for p in params if p in ROW_KWARGS) | (
            frozenset(ROW_KWARGS) if any(p.kind == p.VAR_KEYWORD for p in params.values())
            else frozenset())
        specs.append(ToolSpec(schema["function"]["name"], path, schema, takes))
    seen = [s.name for s in specs]
    if len(set(seen)) != len(seen):
        raise ValueError(f"rollout.tools: two tools share a name ({seen})")
    return specs


def truncate(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, its beginning and end kept around a note of
    what was cut (``rollout.tool_output_chars``)."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n...[{len(text) - limit} characters cut]...\n{text[len(text) - tail:]}"


@dataclass(frozen=True)
class ToolResult:
    """What a call gave the model: the message text, and whether it counts as failed."""

    name: str
    text: str
    failed: bool


def check_call(call: ToolCall, tools: dict[str, ToolSpec]) -> str:
    """Why ``call`` cannot run ('' if it can): malformed, an unknown tool, arguments its schema
    does not allow (missing required ones, names it does not list)."""
    if call.error:
        return call.error
    spec = tools.get(call.name)
    if spec is None:
        return f"unknown tool {call.name!r}; the tools are {', '.join(sorted(tools))}"
    missing = [a for a in spec.required if a not in call.arguments]
    if missing:
        return f"{call.name} needs the argument(s) {', '.join(missing)}"
    allowed = spec.allowed
    extra = sorted(set(call.arguments) - allowed) if allowed is not None else []
    if extra:
        return f"{call.name} takes no argument(s) {', '.join(extra)}"
    return ""


def _run_python(code: object, sandbox: SandboxSpec) -> tuple[bool, str]:
    from mugrpo_megatron.rewards.sandbox import run_python

    if not isinstance(code, str):
        return False, "Error: the code argument must be a string"
    got = run_python(sandbox, {"code.py": code, "main.py": _NOTEBOOK}, "main.py")
    notes = {"timeout": f"Error: the program ran past its time limit ({sandbox.cpu_s:g} CPU s, "
                        f"{sandbox.wall_s:g} s)",
             "memory": f"Error: the program ran out of memory ({sandbox.memory_mb} MB)",
             "output": f"Error: the program printed more than {sandbox.output_kb} KB",
             "sandbox": f"Error: the sandbox failed: {got.detail[:200]}"}
    text = got.stdout
    if got.status in notes:
        text = (text + "\n" if text else "") + notes[got.status]
    return got.status == "ok", text


_FN_CACHE: dict[str, object] = {}


def _call_tool(spec: ToolSpec, arguments: dict, row: dict, sandbox: SandboxSpec
               ) -> tuple[bool, str]:
    """Runs in a worker: (ok, the message text)."""
    try:
        if spec.path == PYTHON:
            return _run_python(arguments.get("code"), sandbox)
        fn = _FN_CACHE.get(spec.path) or _FN_CACHE.setdefault(spec.path,
                                                              _import(spec.path, spec.name))
        extra = {k: dict(row.get(k) or {}) for k in spec.takes_row}
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            value = fn(**arguments, **extra)  # what it prints is not the trainer's console's
        return True, value if isinstance(value, str) else json.dumps(value, default=str)
    except Exception as e:  # noqa: BLE001 - told to the model, counted
        return False, f"Error: {type(e).__name__}: {str(e)[:500]}"


class ToolPool:
    """The workers that run tool calls (``rollout.tool_workers`` processes)."""

    def __init__(self, tools: list[ToolSpec], sandbox: SandboxSpec, workers: int,
                 timeout_s: float, output_chars: int):
        from pebble import ProcessPool

        self.tools = {t.name: t for t in tools}
        self.sandbox, self.timeout_s, self.output_chars = sandbox, timeout_s, output_chars
        # spawn (the engine's threads make fork unsafe); started by this thread, which lives as
        # long as the pool (``procs``: the parent-death signal follows the starting thread)
        self._pool = ProcessPool(max_workers=workers,
                                 context=multiprocessing.get_context("spawn"),
                                 initializer=die_with_parent, initargs=(os.getpid(),))
        self._pool.schedule(os.getpid).result()

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def submit(self, call: ToolCall, row: dict | None = None) -> Future:
        """Start ``call`` (or, for one that cannot run, a future already holding its error)."""
        problem = check_call(call, self.tools)
        if problem:
            done: Future = Future()
            done.set_result((False, f"Error: {problem}"))
            return done
        return self._pool.schedule(_call_tool, args=(self.tools[call.name], call.arguments,
                                                     (row or {}).get(call.name) or {},
                                                     self.sandbox),
                                   timeout=self.timeout_s)

    def result(self, call: ToolCall, future: Future) -> ToolResult:
        """A finished call's message (its time limit, or a worker that died, as an error)."""
        from pebble import ProcessExpired

        try:
            ok, text = future.result()
        except (Exception, ProcessExpired) as e:  # noqa: BLE001 - pebble's TimeoutError
            ok = False
            text = (f"Error: the tool ran past rollout.tool_timeout_s = {self.timeout_s:g} s"
                    if type(e).__name__ == "TimeoutError" else
                    f"Error: the tool's worker died ({type(e).__name__}: {str(e)[:200]})")
        return ToolResult(call.name or "error", truncate(text, self.output_chars), not ok)

    def close(self) -> None:
        from mugrpo_megatron.rewards.sandbox import remove_orphans

        self._pool.stop()
        self._pool.join()
        remove_orphans()  # what its workers' exit handlers did not run to remove

"""The code reward (``reward.name: code``): the program taken from a completion, run on the row's
test cases in the sandbox (``rewards.sandbox``), scored by the share of cases it passes
(``reward.code_score: share``) or 1 only when it passes all (``all``).

**The program** is the last *closed* fenced block of the completion (after the last
``</think>``, when there is one) whose info string is ``python``, ``py``, ``python3`` or empty;
failing that, the last closed fenced block of any language; failing that, no program (the
response scores 0, as a wrong answer does: not a reward failure). A block still open when the
response ends (cut at the length limit) is not a program. verl's ``prime_code`` instead takes
the text after the last "```python" to the next fence or the end.

**The test cases** are the row's ground truth (``data.answer_field``: verl's
``reward_model.ground_truth``), a JSON object as PRIME (Eurus-2-RL), TACO, APPS and
LiveCodeBench store it in verl's parquet layout:

- standard input: ``{"inputs": [...], "outputs": [...]}``: each input is given on stdin (a list
  of lines is joined with newlines) and the program's stdout compared with the output (a list of
  lines likewise);
- function calls: ``{"fn_name": "f", "inputs": [...], "outputs": [...]}``: each input is the
  call's arguments, a JSON list (APPS, TACO) or a string of one JSON value a line
  (LiveCodeBench); ``f`` is a top-level function of the program or a method of its class
  ``Solution`` (LeetCode's form); the output is the value (a string holding JSON is decoded).

A ground truth that is not such an object is a reward failure, counted and named by row.

**Outputs are compared** as those datasets' checkers do, loosest first-match: standard output
equals the expected one line by line after trailing whitespace and trailing blank lines are
dropped, or else token by token (whitespace-separated) with numeric tokens equal within
``math.isclose(rel_tol=1e-5, abs_tol=1e-8)`` (APPS' ``np.allclose`` defaults). A returned value
equals the expected one (tuples as lists, floats within the same tolerance), or the single
element of an expected one-element list (APPS stores call outputs so).

Each standard-input case runs in a fresh sandbox under ``reward.sandbox_*``'s limits with only
its input inside. A program's function-call cases run in one sandboxed process, as APPS' and
LiveCodeBench's checkers call them (one interpreter start a program, not one a case: the cost
of a sandboxed run is mostly the start): the harness runs the program once, then each call
under an alarm of ``sandbox_wall_s``, and writes each value as a JSON line on the stdout it kept
(the program's own prints go to stderr, dropped); the run has ``sandbox_program_s`` of wall
clock and ``sandbox_cpu_s`` CPU seconds a case. The expected outputs never enter the sandbox,
so a program cannot read them.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, replace
from typing import Any

from mugrpo_megatron.rewards.sandbox import SandboxSpec, run_python

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$",
                    re.MULTILINE | re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}
_HARNESS = '''import json, os, signal, sys
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
name, seconds = sys.argv[1], int(sys.argv[2])
calls = json.loads(sys.stdin.read())
def late(*_):
    raise TimeoutError("case time limit")
signal.signal(signal.SIGALRM, late)
scope = {"__name__": "__solution__"}
exec(compile(open(os.path.join(os.path.dirname(__file__), "solution.py")).read(),
             "solution.py", "exec"), scope)
fn = scope.get(name)
if fn is None and "Solution" in scope:
    fn = getattr(scope["Solution"](), name)
for i, args in enumerate(calls):
    signal.alarm(seconds)
    try:
        value = fn(*args)
        signal.alarm(0)
        line = json.dumps({"case": i, "value": value}, default=repr)
    except BaseException as e:
        signal.alarm(0)
        line = json.dumps({"case": i, "error": type(e).__name__})
    out.write(line + "\\n")
    out.flush()
'''

@dataclass(frozen=True)
class Cases:
    """A row's test cases."""

    inputs: list
    outputs: list
    fn_name: str | None = None


def extract_program(completion: str) -> str | None:
    """The program of a completion (the module docstring's rules), or None."""
    text = completion.rsplit("</think>", 1)[-1]
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for tag, body in reversed(blocks):
        if tag in _PYTHON_TAGS:
            return body
    return blocks[-1][1] if blocks else None


def parse_cases(answer: str) -> Cases:
    """The test cases of a ground truth; ValueError saying what is wrong with it."""
    try:
        raw = json.loads(answer)
    except json.JSONDecodeError as e:
        raise ValueError(f"the ground truth is not JSON test cases ({e.msg} at character "
                         f"{e.pos})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("inputs"), list) \
            or not isinstance(raw.get("outputs"), list):
        raise ValueError("the ground truth must be a JSON object with lists 'inputs' and "
                         "'outputs' (and 'fn_name' for function calls)")
    if len(raw["inputs"]) != len(raw["outputs"]) or not raw["inputs"]:
        raise ValueError(f"the ground truth has {len(raw['inputs'])} inputs and "
                         f"{len(raw['outputs'])} outputs (needs as many, at least one)")
    fn = raw.get("fn_name")
    if fn is not None and not (isinstance(fn, str) and fn.isidentifier()):
        raise ValueError(f"the ground truth's fn_name {fn!r} is not a function name")
    return Cases(raw["inputs"], raw["outputs"], fn)


def _lines(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-8)


def _number(token: str) -> float | None:
    try:
        x = float(token)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def stdout_matches(got: str, want: str) -> bool:
    """Standard output against the expected (the module docstring's rules)."""
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    if lines(got) == lines(want):
        return True
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            nx, ny = _number(x), _number(y)
            if nx is None or ny is None or not _close(nx, ny):
                return False
    return True


def value_matches(got: Any, want: Any) -> bool:
    """A returned value (JSON-decoded) against the expected one (the module docstring's rules)."""
    if isinstance(want, str):
        try:
            want = json.loads(want)
        except json.JSONDecodeError:
            pass
    if _equal(got, want):
        return True
    return isinstance(want, list) and len(want) == 1 and _equal(got, want[0])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or _close(float(a), float(b))
    return a == b


def _call_args(value: Any) -> list:
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        return [json.loads(line) for line in value.strip().split("\n") if line.strip()]
    return [value]


def run_case(spec: SandboxSpec, program: str, cases: Cases, i: int) -> bool:
    """Whether ``program`` passes standard-input case ``i`` of ``cases`` in the sandbox (a
    fresh run of its own)."""
    got = run_python(spec, {"solution.py": program}, "solution.py",
                     stdin=_lines(cases.inputs[i]))
    return got.status == "ok" and stdout_matches(got.stdout, _lines(cases.outputs[i]))


def run_calls(spec: SandboxSpec, program: str, cases: Cases, seconds: float) -> list[bool]:
    """Whether ``program`` passes each function-call case of ``cases``: one sandboxed run for
    all of them (as APPS' and LiveCodeBench's checkers call a program's function once per case
    in one process), each call under its own ``spec.wall_s`` alarm inside, the run under
    ``seconds`` of wall clock and ``spec.cpu_s`` CPU seconds a case. A case whose call raises,
    runs out of time, or never starts (the program ended the process) fails; one interpreter
    start a program instead of one a case."""
    try:
        calls = json.dumps([_call_args(x) for x in cases.inputs])
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"the ground truth's inputs are not JSON arguments ({e})") from None
    n = len(cases.inputs)
    whole = replace(spec, wall_s=seconds, cpu_s=min(spec.cpu_s * n, seconds))
    got = run_python(whole, {"solution.py": program, "harness.py": _HARNESS}, "harness.py",
                     stdin=calls, args=(cases.fn_name, str(max(1, math.ceil(spec.wall_s)))))
    passed = [False] * n
    for line in got.stdout.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            break  # cut by the output limit
        i = r.get("case") if isinstance(r, dict) else None
        if isinstance(i, int) and 0 <= i < n and "value" in r:
            passed[i] = value_matches(r["value"], cases.outputs[i])
    return passed


def code_reward(completion: str, answer: str, *, sandbox: SandboxSpec,
                code_score: str = "share") -> float:
    """``reward.name: code``: the share of the row's cases the completion's program passes
    (``code_score: all``: 1 only when it passes every one). Standard-input cases run one at a
    time, each in a fresh sandbox, while a whole case still fits in ``sandbox.program_s`` (the
    rest fail; ``all`` stops at the first failure); function-call cases run in one sandboxed
    run of at most ``sandbox.program_s`` (``run_calls``)."""
    cases = parse_cases(answer)
    program = extract_program(completion)
    if program is None:
        return 0.0
    if cases.fn_name is not None:
        passed = run_calls(sandbox, program, cases, sandbox.program_s)
        if code_score == "all":
            return float(all(passed))
        return sum(passed) / len(passed)
    passed, deadline = 0, time.monotonic() + sandbox.program_s
    for i in range(len(cases.inputs)):
        if time.monotonic() + sandbox.wall_s > deadline:  # the program's time is up: the rest fail
            break
        if run_case(sandbox, program, cases, i):
            passed += 1
        elif code_score == "all":
            return 0.0
    return passed / len(cases.inputs)

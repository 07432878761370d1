"""The code reward (``reward.name: code``): the program taken from a completion, run on the row's
test cases in the sandbox (``rewards.sandbox``), scored by the share of cases it passes
(``reward.code_score: share``) or 1 only when it passes all (``all``).

**The program** is the last *closed* fenced block of the completion (after the last
``</think>``, when there is one) tagged ``python``, ``py`` or ``python3``; failing that, the last
closed untagged block; failing that, the last closed block of any language; failing that, no
program (the response scores 0, as a wrong answer does: not a reward failure). An untagged block
after the tagged program (an example input, the expected output) is so not taken for it, as
verl's ``prime_code`` would not take it (it takes the text after the last "```python" to the
next fence or the end); unlike verl, a block still open when the response ends (cut at the
length limit) is not a program, and an answer in one untagged block is still read.

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
dropped, or else token by token (whitespace-separated): an expected integer only by an integer
equal to it (1000000012 is not 1000000007, as APPS' ``np.allclose`` would let it be: answers
modulo 10^9 + 7 are common; nor is 1000000007.0 or 1_000_000_007), other numbers within
``math.isclose(rel_tol=1e-5, abs_tol=1e-8)`` (its defaults). A returned value equals the
expected one (tuples as lists, an expected integer only by an equal integer, floats within the
same tolerance),
or the single element of an expected one-element list (APPS stores call outputs so). Whatever
comes back from the program (any line, nesting or number size) is data: what cannot be read
fails that case, never the reward.

Each standard-input case runs in a fresh sandbox under ``reward.sandbox_*``'s limits with only
its input inside, while the program's cases fit in ``sandbox_program_s`` of their own run time
(each run's wall clock; a SandboxFusion service's ``execution_time``, so the time a case waits in
a busy service's queue is not the program's). **A case
not run is no failed case**: a row whose cases the budget cut short (a slow machine, a row of
1500 cases) raises ``CasesNotRun``, which the scorer counts with the timeouts and names by row
(scoring 0, as a timeout does, never stopping the run) instead of scoring the share of a prefix;
``code_score: all`` is 0 at the first failed case, 1 when every case ran and passed.

A program's function-call cases run in one sandboxed process, as APPS' and
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
from mugrpo_megatron.rewards.sandbox_fusion import is_url

_INTEGER = re.compile(r"[+-]?\d+")
_DIGITS = 4300  # Python's int <-> str limit: a longer integer token is compared as text


class CasesNotRun(Exception):
    """A program's cases were cut short by ``reward.sandbox_program_s``: not a failed case."""


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
    for wanted in (_PYTHON_TAGS - {""}, {""}):
        for tag, body in reversed(blocks):
            if tag in wanted:
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
    return len(a) == len(b) and all(_tokens_equal(x, y) for x, y in zip(a, b))


def _tokens_equal(x: str, y: str) -> bool:
    if x == y:
        return True
    if _INTEGER.fullmatch(y):  # an expected integer: an equal integer, nothing near it
        return bool(_INTEGER.fullmatch(x)) and len(x) <= _DIGITS and len(y) <= _DIGITS \
            and int(x) == int(y)
    nx, ny = _number(x), _number(y)
    return nx is not None and ny is not None and _close(nx, ny)


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
    if isinstance(b, int):  # an expected integer: an equal integer (a float near it is not)
        return isinstance(a, int) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        try:
            return a == b or _close(float(a), float(b))
        except OverflowError:  # an integer past a float's range: only equal ones are
            return False
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
    return _case(spec, program, cases, i)[0]


def _case(spec: SandboxSpec, program: str, cases: Cases, i: int) -> tuple[bool, float]:
    """``run_case``, and the seconds the run took by its own clock (the service's
    ``execution_time`` for SandboxFusion; measured around the call where a run reports none)."""
    start = time.monotonic()
    got = run_python(spec, {"solution.py": program}, "solution.py",
                     stdin=_lines(cases.inputs[i]))
    took = got.seconds if got.seconds is not None else time.monotonic() - start
    return got.status == "ok" and stdout_matches(got.stdout, _lines(cases.outputs[i])), took


def run_calls(spec: SandboxSpec, program: str, cases: Cases, seconds: float) -> list[bool]:
    """Whether ``program`` passes each function-call case of ``cases``: one sandboxed run for
    all of them (as APPS' and LiveCodeBench's checkers call a program's function once per case
    in one process), each call under its own ``spec.wall_s`` alarm inside, the run under
    ``seconds`` of wall clock and ``spec.cpu_s`` CPU seconds a case. A case whose call raises,
    runs out of time, or never starts (the program ended the process) fails; one interpreter
    start a program instead of one a case."""
    n = len(cases.inputs)
    got, notes = _run_calls(spec, program, cases, seconds)
    if got.status == "timeout" and None in notes:  # the run's clock ran out before every case
        ran = n - notes.count(None)
        raise CasesNotRun(f"{ran} of {n} function-call cases ran within "
                          f"reward.sandbox_program_s = {seconds:g} s "
                          f"({notes.count('passed')} passed)")
    return [note == "passed" for note in notes]


def _run_calls(spec: SandboxSpec, program: str, cases: Cases, seconds: float):
    """The harness's one sandboxed run of every call (``run_calls``), and each case's note;
    ValueError where the inputs are not JSON arguments."""
    try:
        calls = json.dumps([_call_args(x) for x in cases.inputs])
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"the ground truth's inputs are not JSON arguments ({e})") from None
    whole = replace(spec, wall_s=seconds, cpu_s=min(spec.cpu_s * len(cases.inputs), seconds))
    got = run_python(whole, {"solution.py": program, "harness.py": _HARNESS}, "harness.py",
                     stdin=calls, args=(cases.fn_name, str(max(1, math.ceil(spec.wall_s)))))
    return got, _call_notes(got.stdout, cases)


def _call_notes(stdout: str, cases: Cases) -> list[str | None]:
    """Each function-call case's outcome from the harness's lines: 'passed', 'wrong value',
    'raised <Type>', or None where no line came (it never ran). Anything the program sent (deep
    nesting, integers past 4300 digits, garbage) is data: what cannot be read fails the case."""
    n = len(cases.inputs)
    notes: list[str | None] = [None] * n
    for line in stdout.splitlines():
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):
            break  # cut by the output limit, or not the harness's line: the rest fail
        i = r.get("case") if isinstance(r, dict) else None
        if not (isinstance(i, int) and 0 <= i < n) or notes[i] is not None:
            continue
        if "value" not in r:
            notes[i] = f"raised {str(r.get('error'))[:40]}"
            continue
        try:
            notes[i] = "passed" if value_matches(r["value"], cases.outputs[i]) else "wrong value"
        except RecursionError:
            notes[i] = "wrong value"
    return notes


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
    passed, spent, n = 0, 0.0, len(cases.inputs)
    start = time.monotonic()
    for i in range(n):
        if spent + sandbox.wall_s > sandbox.program_s:  # the program's own time is up
            waited = time.monotonic() - start - spent
            raise CasesNotRun(
                f"{i} of {n} standard-input cases ran within reward.sandbox_program_s = "
                f"{sandbox.program_s:g} s of their own run time ({passed} passed; "
                + (f"{waited:.1f} s waiting in the service's queue not counted"
                   if is_url(sandbox.mode) else "timed here") + "); raise it for rows this long")
        ok, took = _case(sandbox, program, cases, i)
        spent += took
        if ok:
            passed += 1
        elif code_score == "all":
            return 0.0
    return passed / n


def explain(completion: str, answer: str, sandbox: SandboxSpec) -> str:
    """Why a completion scores what it scores, in words (``score --explain``): no program, a
    syntax error, the first case it fails and how (wrong output, an error, a timeout, memory),
    cases cut short, or every case passed. Runs the program again, case by case."""
    try:
        cases = parse_cases(answer)
    except ValueError as e:
        return f"bad ground truth: {e}"
    program = extract_program(completion)
    if program is None:
        return "no program: the completion has no closed fenced code block"
    try:
        compile(program, "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        return f"syntax error: line {getattr(e, 'lineno', '?')}: {getattr(e, 'msg', e)}"
    n = len(cases.inputs)
    if cases.fn_name is not None:
        try:
            got, notes = _run_calls(sandbox, program, cases, sandbox.program_s)
        except ValueError as e:
            return f"bad ground truth: {e}"
        for i, note in enumerate(notes):
            if note is None:
                return (f"case {i} of {n} never ran (the run ended: {got.status}"
                        f"{', ' + got.detail if got.detail else ''})")
            if note != "passed":
                return f"{note} on case {i} of {n}"
        return f"passed all {n} cases"
    for i in range(n):
        got = run_python(sandbox, {"solution.py": program}, "solution.py",
                         stdin=_lines(cases.inputs[i]))
        if got.status != "ok":
            how = {"timeout": "timed out (sandbox_cpu_s or sandbox_wall_s)",
                   "memory": "ran out of memory (sandbox_memory_mb)",
                   "output": "wrote past sandbox_output_kb",
                   "sandbox": "the sandbox failed"}.get(got.status, f"exited with {got.detail}")
            return f"case {i} of {n}: {how}"
        want = _lines(cases.outputs[i])
        if not stdout_matches(got.stdout, want):
            return (f"wrong output on case {i} of {n}: expected {want[:80]!r}, got "
                    f"{got.stdout[:80]!r}")
    return f"passed all {n} cases"

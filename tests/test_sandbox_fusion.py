"""``reward.sandbox: <URL>``: the code reward's programs run by a SandboxFusion service (verl
``sandbox_fusion.url``), here a local service that speaks its protocol with the upstream client
package's models and runs programs for real (``sandbox_fusion_service.py``)."""

import json
import shutil
import socket

import pytest
from sandbox_fusion.models import RunCodeRequest
from sandbox_fusion_service import SandboxFusionService
from test_code_reward import ADD, CASES_CALL, CASES_LCB, CASES_STDIN, code_config, fenced

from mugrpo_megatron.rewards import RewardScorer, RowInfo
from mugrpo_megatron.rewards.sandbox import SandboxSpec, SandboxUnavailable, probe, run_python
from mugrpo_megatron.rewards.sandbox_fusion import endpoint, request_body

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="the local service runs programs in bubblewrap")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_request_is_sandbox_fusions_and_its_endpoint_either_way():
    """The body parses as the client package's RunCodeRequest with every field we set kept (a
    renamed field upstream would be dropped and fail here); the program's arguments reach it as
    sys.argv; the files beside it are base64; the URL may be the root or /run_code."""
    spec = SandboxSpec(mode="http://h:8080", wall_s=4.0, memory_mb=512)
    body = request_body(spec, {"m.py": "import sys\nprint(sys.argv[1:])", "s.py": "x = 1"},
                        "m.py", "in", ("add", "3"))
    parsed = RunCodeRequest(**body).dict()
    for key in ("code", "language", "stdin", "run_timeout", "compile_timeout", "files"):
        assert parsed[key] == body[key], key
    assert body["memory_limit_MB"] == 512  # the server's field (sandbox_api.py), not the client's
    assert body["code"].startswith('import sys\nsys.argv[1:] = ["add", "3"]\n')
    assert body["files"] == {"s.py": "eCA9IDE="}
    assert endpoint("http://h:8080") == endpoint("http://h:8080/run_code/") \
        == "http://h:8080/run_code"
    with pytest.raises(ValueError, match="reward.sandbox: 'http://' is not a URL with a host"):
        endpoint("http://")


def test_code_rewards_through_the_service_equal_the_os_sandboxs():
    """The code reward with reward.sandbox = the service's URL scores as with bwrap: stdin cases,
    function calls (the harness's arguments through sys.argv, solution.py beside it), a loop
    past the wall clock, an output flood, a program that fails; through the scorer's workers."""
    completions = [
        fenced(ADD),
        fenced("a, b = map(int, open(0).read().split())\nprint(a + b if a < 9 else 0)"),
        fenced("print(undefined)"),
        fenced("def add(a, b):\n    print('noise')\n    return a + b"),
        fenced("def twice(xs, n):\n    return xs * n"),
        fenced("while True:\n    pass"),
        fenced("import sys\nwhile True:\n    sys.stdout.write('3\\n' * 65536)"),
    ]
    answers = [CASES_STDIN] * 3 + [CASES_CALL, CASES_LCB, CASES_STDIN, CASES_STDIN]
    rows = [RowInfo("apps", row=i) for i in range(len(answers))]
    with RewardScorer(code_config()) as scorer:
        local = scorer.score(completions, answers, rows).rewards
    service = SandboxFusionService()
    with service as url:
        cfg = code_config(sandbox=url)
        with RewardScorer(cfg) as scorer:
            out = scorer.score(completions, answers, rows)
    assert out.rewards == local == [1.0, pytest.approx(2 / 3), 0.0, 1.0, 1.0, 0.0, 0.0], out
    # the endless loop: the service has no CPU limit, so each of its cases takes the whole wall
    # clock (3 s) and the third cannot start within sandbox_program_s (9 s): counted as cut
    # short (a case not run is no failed case), where the OS sandbox ends each at 1 CPU second
    assert out.failed == [5] and "cases cut short: 2 of 3" in out.errors[0], out.errors
    sent = {json.dumps(r["files"], sort_keys=True) for r in service.requests}
    assert any("harness" not in s and "solution.py" in s for s in sent)  # a call run's files
    assert {r["run_timeout"] for r in service.requests} <= {3.0, 9.0}
    assert {r["memory_limit_MB"] for r in service.requests} == {1024}


def test_a_busy_services_queue_is_not_the_programs_time():
    """A correct program's three cases, each waiting 4 s in the service's queue: by the wall
    clock they did not fit sandbox_program_s = 9 s and the row was cut short (scored 0; the
    suite's flake on a loaded machine); by the service's execution_time every case runs. An
    endless loop's cases still use the budget up, and the reason says the queue's wait."""
    service = SandboxFusionService()
    with service as url:
        service.queue_s = 4.0
        cfg = code_config(sandbox=url)
        assert cfg.scoring_timeout_s == 9.0 + 10 + 60
        with RewardScorer(cfg) as scorer:
            out = scorer.score([fenced(ADD), fenced("while True:\n    pass")],
                               [CASES_STDIN] * 2, [RowInfo("apps", row=i) for i in range(2)])
    assert out.rewards == [1.0, 0.0] and out.failed == [1], out
    assert "2 of 3 standard-input cases ran within reward.sandbox_program_s = 9 s of their own " \
           "run time" in out.errors[0] and "waiting in the service's queue not counted" \
           in out.errors[0], out.errors


def test_a_busy_service_is_tried_again_and_an_absent_one_named():
    """SandboxError and HTTP 500 are tried again (the program then runs once); a service that
    keeps failing fails the run as 'sandbox' with its message; probe names an unreachable
    service, and train refuses before any process group with the choices."""
    service = SandboxFusionService()
    with service as url:
        spec = SandboxSpec(mode=url, wall_s=2.0, program_s=30.0)
        service.fail_next = ["sandbox_error", "http_500"]
        got = run_python(spec, {"m.py": "print(6 * 7)"}, "m.py")
        assert (got.status, got.stdout, len(service.requests)) == ("ok", "42\n", 3)
        service.fail_next = ["sandbox_error"] * 4
        got = run_python(spec, {"m.py": "print(6 * 7)"}, "m.py")
        assert got.status == "sandbox" and "SandboxError: busy" in got.detail, got
        probe(spec)
    absent = SandboxSpec(mode=f"http://127.0.0.1:{closed_port()}", wall_s=1.0, program_s=2.0)
    with pytest.raises(SandboxUnavailable, match="the SandboxFusion service cannot run a "
                                                 "program .*Connection refused.*bwrap"):
        probe(absent)


def test_train_refuses_an_unreachable_service(tmp_path, capsys):
    from mugrpo_megatron.__main__ import main
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=1)
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"question": "add", "answer": CASES_STDIN}) + "\n")
    url = f"http://127.0.0.1:{closed_port()}"
    base = ["--set", f"model.path={hf}", "--set", f"data.path={data}", "--set",
            "reward.name=code", "--set", f"logging.run_dir={tmp_path / 'run'}",
            "--set", f"reward.sandbox={url}", "--set", "reward.sandbox_program_s=10"]
    assert main(["plan", *base]) == 2
    err = capsys.readouterr().err
    assert "error: reward.sandbox: the SandboxFusion service cannot run a program" in err, err
    assert not (tmp_path / "run").exists()
    with SandboxFusionService() as live:
        assert main(["plan", *base[:-4], "--set", f"reward.sandbox={live}"]) == 0

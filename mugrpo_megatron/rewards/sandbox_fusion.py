"""Programs run by a SandboxFusion service (``reward.sandbox: http://host:port``), for users who
run one (verl ``reward_model.sandbox_fusion.url``).

SandboxFusion (github.com/bytedance/SandboxFusion; read at commit 469de08, 2026-07) is an HTTP
service in a Docker image: ``POST /run_code`` with ``{"code", "language", "stdin",
"run_timeout", "compile_timeout", "memory_limit_MB", "files"}`` (``sandbox/server/
sandbox_api.py`` ``RunCodeRequest``). For ``language: python`` it writes each of ``files``
(base64, paths relative) into a fresh temporary directory, the code into a ``.py`` file there,
and runs ``python that_file`` in that directory with ``stdin`` (``sandbox/runners/major.py``
``run_python``, ``base.py`` ``restore_files``). It answers ``{"status": "Success" | "Failed" |
"SandboxError", "message", "run_result": {"status": "Finished" | "TimeLimitExceeded" |
"Error", "return_code", "stdout", "stderr", ...}}``. The same request and answer are the
``sandbox-fusion`` client package's ``RunCodeRequest`` / ``RunCodeResponse`` (0.3.7), which the
tests check ours against.

What the service enforces is its own: the wall clock (``run_timeout`` = ``reward.sandbox_wall_s``)
and the address space (``memory_limit_MB`` = ``reward.sandbox_memory_mb``); its isolation
(network, files, processes) is its deployment's. ``reward.sandbox_cpu_s``, ``_processes`` and
``_file_mb`` have no field in its request and are not applied; ``sandbox_output_kb`` is applied
here to what comes back. A program's arguments have no field either: they are set in
``sys.argv`` by a first line of the code.

A program's cases count the service's own ``execution_time`` against ``sandbox_program_s``,
not the time a request waited in its queue: a busy service does not cut a correct program's
cases short (``rewards.code``). A request may wait ``QUEUE_S`` for the service beyond its
``run_timeout``.

Failures of the service itself (no connection, an HTTP error, ``SandboxError``) are tried again
``RETRIES`` times with a doubling pause while the program's time (``sandbox_program_s``) lasts,
then the run counts as ``'sandbox'`` (the case fails); the scorer's ``reward.timeout_s`` stays
above everything. Each scoring worker has one request in flight, so ``reward.num_workers`` is
verl's ``sandbox_fusion.max_concurrent``. Only the standard library speaks HTTP here.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from mugrpo_megatron.config.run import SERVICE_QUEUE_S
from mugrpo_megatron.rewards.sandbox_spec import RunResult

RETRIES = 3
"""Further tries of a request the service failed (not of a program that failed)."""
HTTP_SLACK_S = 5.0
"""Seconds a request may take beyond the program's run_timeout (the start of its interpreter)
on a service with nothing queued."""
QUEUE_S = SERVICE_QUEUE_S
"""Seconds more a request may wait in the service's queue before it counts as the service's
failure (and is tried again); the scorer's timeout grows by as much (``RewardConfig.
scoring_timeout_s``) and stays the bound over a response."""


def is_url(mode: str) -> bool:
    """Whether ``reward.sandbox`` names a SandboxFusion service."""
    return mode.startswith(("http://", "https://"))


def endpoint(url: str) -> str:
    """The ``/run_code`` endpoint of ``url`` (verl's examples give the endpoint itself, the
    service's docs its root: either is taken)."""
    parts = urlsplit(url)
    if not parts.netloc:
        raise ValueError(f"reward.sandbox: {url!r} is not a URL with a host")
    path = parts.path.rstrip("/")
    return url.rstrip("/") if path.endswith("/run_code") else url.rstrip("/") + "/run_code"


def request_body(spec, files: dict[str, str], main: str, stdin: str,
                 args: tuple[str, ...]) -> dict:
    """The ``/run_code`` request that runs ``python main args`` with ``files`` beside it."""
    code = files[main]
    if args:
        code = f"import sys\nsys.argv[1:] = {json.dumps(list(args))}\n" + code
    return {"code": code, "language": "python", "stdin": stdin,
            "run_timeout": float(spec.wall_s), "compile_timeout": float(spec.wall_s),
            "memory_limit_MB": int(spec.memory_mb),
            "files": {name: base64.b64encode(text.encode()).decode()
                      for name, text in files.items() if name != main}}


def run(spec, files: dict[str, str], main: str, stdin: str, args: tuple[str, ...]):
    """Run a program through the service at ``spec.mode``: a ``sandbox.RunResult``."""

    body = json.dumps(request_body(spec, files, main, stdin, args)).encode()
    deadline = time.monotonic() + spec.program_s
    error, pause = "", 1.0
    for attempt in range(1 + RETRIES):
        try:
            reply = _post(endpoint(spec.mode), body, spec.wall_s + HTTP_SLACK_S + QUEUE_S)
        except _ServiceError as e:
            error = str(e)
        else:
            return result_of(spec, reply)
        if attempt == RETRIES or time.monotonic() + pause > deadline:
            break
        time.sleep(pause)
        pause *= 2
    return RunResult("sandbox", "", None, f"SandboxFusion at {spec.mode}: {error}")


def result_of(spec, reply: dict):
    """A ``sandbox.RunResult`` from a ``/run_code`` answer whose status is not SandboxError."""

    run_result = reply.get("run_result") or {}
    status = run_result.get("status")
    out = run_result.get("stdout") or ""
    code = run_result.get("return_code")
    took = run_result.get("execution_time")
    took = float(took) if isinstance(took, (int, float)) else None
    cap = spec.output_kb << 10
    if len(out.encode()) > cap:
        return RunResult("output", out.encode()[:cap].decode("utf-8", "replace"), code,
                         f"more than {spec.output_kb} KB of output", seconds=took)
    if status == "TimeLimitExceeded":
        return RunResult("timeout", out, code, "TimeLimitExceeded", seconds=took)
    if status == "Finished" and code == 0:
        return RunResult("ok", out, code, seconds=took)
    return RunResult("error", out, code, f"{status} exit {code}", seconds=took)


class _ServiceError(Exception):
    """The service did not run the program (the request is worth another try)."""


def _post(url: str, body: bytes, timeout: float) -> dict:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise _ServiceError(f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}") \
            from None
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        raise _ServiceError(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
    if not isinstance(reply, dict) or reply.get("status") not in ("Success", "Failed"):
        message = reply.get("message", "") if isinstance(reply, dict) else reply
        raise _ServiceError(f"SandboxError: {str(message)[:200]}")
    return reply

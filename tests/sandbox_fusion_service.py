"""A local stand-in for a SandboxFusion service, for the tests of ``reward.sandbox: <URL>``.

SandboxFusion itself is a Docker image that CI cannot pull. This service speaks its ``/run_code``
protocol with the upstream client package's own models (``sandbox_fusion.models``, 0.3.7: the
request is parsed by ``RunCodeRequest``, the answer built by ``RunCodeResponse``), so a field we
send or read that upstream renamed fails here. It runs the request as SandboxFusion's
``run_python`` does (commit 469de08, ``sandbox/runners/major.py``): the decoded ``files`` beside
the code's own ``.py`` file, ``python`` that file with ``stdin``, ``run_timeout`` its wall clock
(``TimeLimitExceeded`` past it) and ``memory_limit_MB`` its address space; it executes them for
real, in our OS sandbox, and reports the run's own time as ``execution_time``. Runs take turns
(one at a time a process, ``sandbox._one_run``), so concurrent requests queue as on a busy
service; ``queue_s`` adds a wait to each. ``fail_next`` makes the next requests fail as a busy service does
(``SandboxError``, or HTTP 500), for the client's retries.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sandbox_fusion.models import CommandRunResult, RunCodeRequest, RunCodeResponse

from mugrpo_megatron.rewards.sandbox import SandboxSpec, run_python


class SandboxFusionService:
    """``with SandboxFusionService() as url:`` a service at ``url`` until the block ends."""

    def __init__(self, spec: SandboxSpec | None = None):
        self.spec = spec or SandboxSpec()
        self.requests: list[dict] = []
        self.fail_next: list[str] = []  # 'sandbox_error' or 'http_500', one a request
        self.queue_s = 0.0
        """Seconds each request waits before it runs, as in a busy service's queue (its
        execution_time does not count them, as SandboxFusion's does not)."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    def __enter__(self) -> str:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def run_code(self, body: dict) -> tuple[int, str]:
        self.requests.append(body)
        if self.fail_next:
            failure = self.fail_next.pop(0)
            if failure == "http_500":
                return 500, "Internal Server Error"
            return 200, RunCodeResponse(status="SandboxError", message="busy").json()
        time.sleep(self.queue_s)  # waiting behind other users' programs
        request = RunCodeRequest(**body)
        assert request.language == "python"
        files = {name: base64.b64decode(text).decode() for name, text in request.files.items()}
        files["tmp_main.py"] = request.code
        spec = replace(self.spec, wall_s=request.run_timeout,
                       memory_mb=body.get("memory_limit_MB", self.spec.memory_mb))
        got = run_python(spec, files, "tmp_main.py", stdin=request.stdin or "")
        status = {"timeout": "TimeLimitExceeded", "sandbox": "Error"}.get(got.status, "Finished")
        result = CommandRunResult(status=status, return_code=got.returncode, stdout=got.stdout,
                                  stderr="", execution_time=got.seconds)
        ok = status == "Finished" and got.returncode == 0
        return 200, RunCodeResponse(status="Success" if ok else "Failed", message="",
                                    run_result=result).json()

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                if self.path != "/run_code":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, text = service.run_code(body)
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler

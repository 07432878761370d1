"""What a sandboxed run is given and gives back: the sandbox's settings (``SandboxSpec``, from
``reward.sandbox*``) and one run's result (``RunResult``), shared by the OS sandbox
(``rewards.sandbox``) and the SandboxFusion client (``rewards.sandbox_fusion``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

OS_SANDBOX = "bwrap"
UNSAFE = "unsafe"
SANDBOX_UID_BASE = 100_000
"""Run as root, a program runs as ``SANDBOX_UID_BASE +`` its scoring worker's pid: one id a
concurrent run, so that ``RLIMIT_NPROC`` bounds each run's own processes."""


class SandboxUnavailable(ValueError):
    """The sandbox cannot run a program here; the message names the cause and the choices."""


@dataclass(frozen=True)
class SandboxSpec:
    """How a program runs (``reward.sandbox*``): what travels to the scoring workers."""

    mode: str = OS_SANDBOX
    python: str = ""
    """The interpreter inside ('' : the scorer's own base interpreter, not its virtualenv)."""
    cpu_s: float = 5.0
    wall_s: float = 10.0
    program_s: float = 30.0
    """All of one program's runs (the code reward's test cases)."""
    memory_mb: int = 1024
    processes: int = 32
    file_mb: int = 16
    output_kb: int = 1024
    bwrap: str = "bwrap"

    @classmethod
    def of(cls, cfg) -> SandboxSpec:
        """The sandbox a ``RewardConfig`` describes (``reward.sandbox*``)."""
        return cls(mode=cfg.sandbox, python=cfg.sandbox_python or "", cpu_s=cfg.sandbox_cpu_s,
                   wall_s=cfg.sandbox_wall_s, program_s=cfg.sandbox_program_s,
                   memory_mb=cfg.sandbox_memory_mb, processes=cfg.sandbox_processes,
                   file_mb=cfg.sandbox_file_mb, output_kb=cfg.sandbox_output_kb)

    @property
    def interpreter(self) -> str:
        return self.python or os.path.realpath(getattr(sys, "_base_executable", sys.executable))


@dataclass(frozen=True)
class RunResult:
    """One run of a program."""

    status: str
    """'ok' (exited 0), 'error' (exited otherwise), 'timeout' (past the CPU or wall limit),
    'memory' (the kernel ended it at the run's memory limit: ``rewards.cgroups``), 'output'
    (past the output limit), 'sandbox' (the sandbox itself failed)."""
    stdout: str
    returncode: int | None
    detail: str = ""
    cpu_s: float | None = None
    """CPU seconds of the run's whole tree (its control group's); None without one."""
    seconds: float | None = None
    """The run's own wall-clock time: measured here from its start to its end, or as a
    SandboxFusion service reports it (``execution_time``: its queue not counted); None where
    unknown. What a program's cases count against ``sandbox_program_s``."""

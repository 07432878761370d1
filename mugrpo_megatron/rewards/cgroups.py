"""One control group per sandboxed run, where the scorer may make one: the run's whole tree held
to ``reward.sandbox_memory_mb`` of memory (what the per-process address-space limit misses too:
System V segments, memfd files, the page cache and kernel memory of its tmpfs files), to
``sandbox_processes`` tasks, and its CPU time summed over every process of it (the watcher ends
the run past ``sandbox_cpu_s``; ``RLIMIT_CPU`` is per process).

cgroup v2 (``/sys/fs/cgroup`` a cgroup2 file system) where the scorer's own group hands its
children the memory and pids controllers (a delegated subtree: the group's
``cgroup.subtree_control``); else cgroup v1's memory, pids and cpuacct hierarchies (a hybrid
layout, as on this project's machines), each group made under the scorer's own in that
hierarchy. Run as an unprivileged user without a delegated subtree there is none: the sandbox
then says so at start (``rewards.sandbox.probe``) and the limits stay per process.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "mugrpo-sandbox-"
_counter = itertools.count()


def _own_groups() -> dict[str, str]:
    """controller (or '' for v2) -> this process's group path, from /proc/self/cgroup."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


@dataclass
class RunGroup:
    """The groups of one run (one directory for v2, one a controller for v1)."""

    dirs: dict[str, Path]
    """'memory', 'pids', 'cpu' -> the group's directory (the same one for v2)."""
    v2: bool

    @classmethod
    def create(cls, memory_bytes: int, tasks: int) -> RunGroup | None:
        """A fresh group for a run, its limits set; None where the scorer may not make one."""
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            return cls._create_v2(name, memory_bytes, tasks) if (ROOT / "cgroup.controllers") \
                .is_file() else cls._create_v1(name, memory_bytes, tasks)
        except OSError:
            return None

    @classmethod
    def _create_v2(cls, name: str, memory_bytes: int, tasks: int) -> RunGroup | None:
        own = ROOT / _own_groups()[""].lstrip("/")
        if not {"memory", "pids"} <= set((own / "cgroup.subtree_control").read_text().split()):
            return None
        d = own / name
        d.mkdir()
        group = cls({"memory": d, "pids": d, "cpu": d}, True)
        try:
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(tasks))
        except OSError:
            group.remove()
            raise
        return group

    @classmethod
    def _create_v1(cls, name: str, memory_bytes: int, tasks: int) -> RunGroup | None:
        own = _own_groups()
        where = {"memory": "memory", "pids": "pids", "cpu": "cpuacct"}
        dirs: dict[str, Path] = {}
        group = cls(dirs, False)
        try:
            for key, controller in where.items():
                if controller not in own or not (ROOT / controller).is_dir():
                    group.remove()
                    return None
                d = ROOT / controller / own[controller].lstrip("/") / name
                d.mkdir()
                dirs[key] = d
            (dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap = dirs["memory"] / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(memory_bytes))
            (dirs["pids"] / "pids.max").write_text(str(tasks))
        except OSError:
            group.remove()
            raise
        return group

    def join(self) -> None:
        """Put the calling process (the run's first, before exec) in every group of the run."""
        pid = str(os.getpid())
        for d in set(self.dirs.values()):
            (d / "cgroup.procs").write_text(pid)

    def cpu_seconds(self) -> float:
        """CPU time of every process the run had, alive or ended."""
        d = self.dirs["cpu"]
        if self.v2:
            stat = dict(line.split() for line in (d / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int((d / "cpuacct.usage").read_text()) / 1e9

    def out_of_memory(self) -> bool:
        """Whether the kernel ended a process of the run at its memory limit."""
        d = self.dirs["memory"]
        try:
            text = (d / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        except OSError:
            return False
        fields = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(fields.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        """End whatever is left of the run in the groups and remove them."""
        for d in set(self.dirs.values()):
            _remove(d)


def _remove(d: Path, patience_s: float = 2.0) -> None:
    deadline = time.monotonic() + patience_s
    while True:
        try:
            pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # left for remove_orphans at the next start
            time.sleep(0.02)


def remove_orphans() -> list[Path]:
    """Groups of runs whose scoring worker is dead (a killed worker leaves its run's group):
    removed; returns them."""
    own = _own_groups()
    bases = [ROOT / own[""].lstrip("/")] if (ROOT / "cgroup.controllers").is_file() else [
        ROOT / c / own[c].lstrip("/") for c in ("memory", "pids", "cpuacct") if c in own]
    gone = []
    for base in bases:
        try:
            entries = list(base.glob(f"{PREFIX}*"))
        except OSError:
            continue
        for d in entries:
            pid = d.name[len(PREFIX):].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove(d)
                gone.append(d)
    return gone

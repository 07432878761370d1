"""A control group for a scoring worker's sandboxed runs, where the scorer may make one: each run's
whole tree held to ``reward.sandbox_memory_mb`` of memory (what the per-process address-space
limit misses too: System V segments, memfd files, the page cache and kernel memory of its tmpfs
files, socket buffers), and its CPU time summed over every process of it (the watcher ends the run past
``sandbox_cpu_s``; ``RLIMIT_CPU`` is per process). Processes stay bounded by ``RLIMIT_NPROC``
(a user of its own a run, as root): a pids limit on a group its runs share would count the tasks
of earlier runs' PID namespaces that the kernel has not released yet (seen here: one more a run
on cgroup v1, in ``pids.current`` with ``cgroup.procs`` empty).

cgroup v2 (``/sys/fs/cgroup`` a cgroup2 file system) where the scorer's own group hands its
children the memory controller (a delegated subtree: the group's ``cgroup.subtree_control``);
else cgroup v1's memory and cpuacct hierarchies (a hybrid layout, as on this project's
machines), each group made under the scorer's own in that hierarchy. Run as an unprivileged user
without a delegated subtree there is none: the sandbox then says so at start
(``rewards.sandbox.probe``) and the limits stay per process.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "mugrpo-sandbox-"
_counter = itertools.count()
_worker: RunGroup | None = None


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
    """The groups a scoring worker's runs go in, one run at a time (one directory for v2, one a
    controller for v1): made once a worker (``for_worker``), each run's CPU time and memory
    events read against their values when it began (``begin``)."""

    dirs: dict[str, Path]
    """'memory', 'cpu' -> the group's directory (the same one for v2)."""
    v2: bool
    limit: int = 0
    cpu_base: float = 0.0
    oom_base: int = 0

    @classmethod
    def for_worker(cls, memory_bytes: int) -> RunGroup | None:
        """This process's group for its runs, made at its first run (None where it may make
        none); made anew where the limits change. A group a run would add a mkdir and an rmdir
        that waits (in 20 ms steps) for the kernel to let go of the run's tasks."""
        global _worker
        if _worker is not None and _worker.limit != memory_bytes:
            _worker.remove()
            _worker = None
        if _worker is None:
            _worker = cls.create(memory_bytes)
            if _worker is not None:
                _worker.limit = memory_bytes
                atexit.register(_worker.remove)  # a killed worker's: remove_orphans, later
        return _worker

    def begin(self) -> None:
        """Before a run: end anything a run before left in the group (a process that left the
        previous run's process group), and take the counters' values."""
        self.kill()
        self.cpu_base = 0.0  # cpu_seconds() is measured from it
        self.cpu_base, self.oom_base = self.cpu_seconds(), self._oom_kills()

    def kill(self) -> None:
        """SIGKILL every process in the group (after a run: what escaped its process group)."""
        for d in set(self.dirs.values()):
            _kill_members(d)

    @classmethod
    def create(cls, memory_bytes: int) -> RunGroup | None:
        """A fresh group for a run, its limits set; None where the scorer may not make one."""
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            return cls._create_v2(name, memory_bytes) if (ROOT / "cgroup.controllers") \
                .is_file() else cls._create_v1(name, memory_bytes)
        except OSError:
            return None

    @classmethod
    def _create_v2(cls, name: str, memory_bytes: int) -> RunGroup | None:
        own = ROOT / _own_groups()[""].lstrip("/")
        if "memory" not in (own / "cgroup.subtree_control").read_text().split():
            return None
        d = own / name
        d.mkdir()
        group = cls({"memory": d, "cpu": d}, True)
        try:
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
        except OSError:
            group.remove()
            raise
        return group

    @classmethod
    def _create_v1(cls, name: str, memory_bytes: int) -> RunGroup | None:
        own = _own_groups()
        where = {"memory": "memory", "cpu": "cpuacct"}
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
            # v1 charges socket buffers to a counter of their own, which memory.limit_in_bytes
            # does not cover (a program held 1.2 GB of TCP buffers on loopback under 128 MiB);
            # v2 charges them to memory.current, under memory.max
            tcp = dirs["memory"] / "memory.kmem.tcp.limit_in_bytes"
            if tcp.exists():
                tcp.write_text(str(memory_bytes))
        except OSError:
            group.remove()
            raise
        return group

    def join(self) -> None:
        """Put the calling process (the run's first, between fork and exec) in the group: plain
        system calls on paths made beforehand (``_procs``)."""
        pid = str(os.getpid()).encode()
        for path in self._procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    @property
    def _procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def cpu_seconds(self) -> float:
        """CPU time of every process the run had, alive or ended (since ``begin``)."""
        d = self.dirs["cpu"]
        if self.v2:
            stat = dict(line.split() for line in (d / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6 - self.cpu_base
        return int((d / "cpuacct.usage").read_text()) / 1e9 - self.cpu_base

    def out_of_memory(self) -> bool:
        """Whether the kernel ended a process of the run at its memory limit (since ``begin``)."""
        return self._oom_kills() > self.oom_base

    def _oom_kills(self) -> int:
        d = self.dirs["memory"]
        try:
            text = (d / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        fields = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        """End whatever is left of the run in the groups and remove them."""
        for d in set(self.dirs.values()):
            _remove(d)


def _kill_members(d: Path) -> None:
    """SIGKILL every process in the group ``d`` (none where it is gone)."""
    try:
        pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _remove(d: Path, patience_s: float = 2.0) -> None:
    deadline = time.monotonic() + patience_s
    while True:
        _kill_members(d)
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
        ROOT / c / own[c].lstrip("/") for c in ("memory", "cpuacct") if c in own]
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

"""Running a program a policy wrote, at the operating system's level of isolation.

A code reward executes what the policy wrote: a fork bomb, a memory bomb, an endless loop, a
connection into the cluster, a read of the run's checkpoints or the user's credentials, a write
outside its directory, a kill of the scorer. Each run here is one process tree in a sandbox of
its own (``reward.sandbox``):

- ``bwrap`` (the default): bubblewrap (Debian/Ubuntu ``bubblewrap``, Fedora/RHEL ``bubblewrap``,
  conda-forge ``bubblewrap``; what Flatpak runs its apps in), chosen over nsjail because every
  distribution packages it, it needs no daemon, no root and no configuration file, and it is one
  ~70 KB binary. The program sees a new mount namespace holding, read-only, only ``/usr`` and
  the interpreter's own directory (its parents made 0755 and empty), a fresh ``/proc`` and
  ``/dev``, and a private ``/tmp`` (tmpfs of ``reward.sandbox_file_mb``) as its working
  directory: no home, no ``/etc``, no run directory, no checkpoint. New network (its own
  loopback only, up), PID, IPC, UTS and cgroup namespaces; an empty environment; no capabilities
  and no new privileges (bwrap sets ``PR_SET_NO_NEW_PRIVS``); a fresh session keyring and a
  system-call filter (``rewards.syscalls``: the keyring calls, System V IPC, memfd, io_uring,
  userfaultfd, perf events, namespaces and mounts, AF_VSOCK refused). Run as root (a container's
  usual user), the program drops to a user id of its own (``100000 +`` the scoring worker's pid,
  through ``setpriv``), so that ``RLIMIT_NPROC`` counts its processes alone (Linux exempts uid 0
  from that limit); run as another user, bwrap makes an unprivileged user namespace and the
  limit is that user's processes now plus ``reward.sandbox_processes``.
- ``unsafe``: the same limits on a plain child process group, no isolation at all (the program
  sees what the scorer sees); ``train`` says so at every start.
- a URL (``http://host:port``): a SandboxFusion service the user runs (verl
  ``sandbox_fusion.url``), ``rewards/sandbox_fusion.py``; its isolation is the service's.

Limits of every run (``resource.setrlimit`` before bwrap starts, inherited): CPU seconds
(``reward.sandbox_cpu_s``), address space (``sandbox_memory_mb``), processes, file size
(``sandbox_file_mb``), open files 256, no core files; where the scorer may make one, a control
group of the run (``rewards.cgroups``) holds its whole tree to ``sandbox_memory_mb`` of memory
(System V, memfd and tmpfs kernel memory included) and ``sandbox_processes`` tasks, and its
summed CPU time to ``sandbox_cpu_s`` (read by the watcher); the wall clock
(``sandbox_wall_s``) and the output (``sandbox_output_kb`` of stdout; stderr is dropped) are
watched from here. Past any
of them the whole tree is ended: bwrap is killed, and its ``--die-with-parent`` takes the
sandbox's init with it, and with that init the kernel ends every process of its PID namespace
(a detached, re-parented or ``setsid`` child included). The host directory holding the program
and the run's group are removed after each run; those a killed worker left are removed at the
next start (``remove_orphans``).

One run at a time a process: the run's control group and its user id are the process's, so a
run's start would end another's tree. Threads of one process (a service serving requests on
threads) take their turns (``_one_run``); the scoring and tool workers are processes, one run
each at a time, and run side by side.
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from mugrpo_megatron.rewards import cgroups, sandbox_fusion, syscalls
from mugrpo_megatron.rewards.sandbox_fusion import is_url
from mugrpo_megatron.rewards.sandbox_spec import (  # noqa: F401 - the sandbox's names, here too
    OS_SANDBOX,
    SANDBOX_UID_BASE,
    UNSAFE,
    RunResult,
    SandboxSpec,
    SandboxUnavailable,
)


def run_python(spec: SandboxSpec, files: dict[str, str], main: str, stdin: str = "",
               args: tuple[str, ...] = ()) -> RunResult:
    """Run ``python main args`` with ``files`` ({name: text}) in its working directory's view
    (read-only, at ``/sandbox``) and ``stdin`` as its input; its stdout back (at most
    ``spec.output_kb``)."""
    if is_url(spec.mode):
        return sandbox_fusion.run(spec, files, main, stdin, args)
    if spec.mode not in (OS_SANDBOX, UNSAFE):
        raise SandboxUnavailable(f"reward.sandbox: {spec.mode!r} runs nothing here: use "
                                 f"{OS_SANDBOX!r}, {UNSAFE!r} or a SandboxFusion URL")
    with _one_run:
        return _run_here(spec, files, main, stdin, args)


_one_run = threading.Lock()
"""Held over a run in this process (see the module's docstring)."""


def _run_here(spec: SandboxSpec, files: dict[str, str], main: str, stdin: str,
              args: tuple[str, ...]) -> RunResult:
    global _cleaned
    if not _cleaned:  # a worker replacing a killed one removes what that one left
        _cleaned = True
        remove_orphans()
    host = Path(tempfile.mkdtemp(prefix=f"{HOST_PREFIX}{os.getpid()}.{_pid_namespace()}-"))
    group, seccomp = None, None
    try:
        code = host / "code"
        code.mkdir()
        for name, text in files.items():
            (code / name).write_text(text)
        (host / "stdin").write_text(stdin)
        # the run's tree: its memory (what RLIMIT_AS misses too) and summed CPU time
        group = cgroups.RunGroup.for_worker(spec.memory_mb << 20)
        if group is not None:
            group.begin()
        if spec.mode == OS_SANDBOX:
            seccomp = syscalls.filter_fd()
            cmd = _bwrap_command(spec, code, main, args, seccomp)
            uid = SANDBOX_UID_BASE + os.getpid() if os.geteuid() == 0 else None
            nproc = spec.processes if uid is not None else _user_tasks() + spec.processes
        else:
            cmd = [spec.interpreter, "-I", str(code / main), *args]
            nproc = _user_tasks() + spec.processes
        with open(host / "stdin", "rb") as stdin_file:
            return _watch(spec, cmd, stdin_file, nproc, cwd=host if spec.mode == UNSAFE else None,
                          group=group, keep=(seccomp,) if seccomp is not None else ())
    finally:
        if seccomp is not None:
            os.close(seccomp)
        if group is not None:
            group.kill()  # what left the run's process group (the unsafe mode's setsid child)
        shutil.rmtree(host, ignore_errors=True)


def probe(spec: SandboxSpec) -> list[str]:
    """Run ``print(...)`` in the sandbox once: ``SandboxUnavailable`` naming the cause and the
    choices when it cannot (no bwrap, no libseccomp, user namespaces off, an interpreter it
    cannot see). Removes what killed workers left (``remove_orphans``). Returns what the sandbox
    cannot bound here, to be said at start (no control group: memory and CPU per process)."""
    remove_orphans()
    notes = [] if is_url(spec.mode) else _shortfalls(spec)
    if spec.mode == UNSAFE:
        return notes
    choices = (f"reward.sandbox: {OS_SANDBOX} (the OS sandbox; install bubblewrap: apt install "
               f"bubblewrap, dnf install bubblewrap or conda install -c conda-forge bubblewrap), "
               f"the URL of a SandboxFusion service you run (http://host:8080), "
               f"{UNSAFE!r} (no isolation at all: only for programs you trust)")
    if not is_url(spec.mode):
        try:
            syscalls.filter_program()
        except syscalls.FilterUnavailable as e:
            raise SandboxUnavailable(f"reward.sandbox: {e}. Choose: {choices}") from None
        if shutil.which(spec.bwrap) is None:
            raise SandboxUnavailable(f"reward.sandbox: the OS sandbox needs bubblewrap, and "
                                     f"{spec.bwrap!r} is not on PATH. Choose: {choices}")
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            raise SandboxUnavailable(f"reward.sandbox: run as root, the OS sandbox drops to a "
                                     f"user of its own with setpriv (util-linux), which is not "
                                     f"on PATH. Choose: {choices}")
    got = run_python(spec, {"probe.py": "print(6 * 7)\n"}, "probe.py")
    if got.status == "ok" and got.stdout.strip() == "42":
        return notes
    seen = f"{got.status}: {(got.detail or got.stdout).strip()[:300] or 'no output'}"
    if is_url(spec.mode):
        raise SandboxUnavailable(
            f"reward.sandbox: the SandboxFusion service cannot run a program ({seen}). Start it "
            f"(docker run -p 8080:8080 <its image>) or choose: {choices}")
    raise SandboxUnavailable(
        f"reward.sandbox: the OS sandbox cannot run a program here ({seen}). Common causes: "
        f"user namespaces are off (sysctl kernel.unprivileged_userns_clone=0 or "
        f"user.max_user_namespaces=0, as on some clusters), or the interpreter "
        f"{spec.interpreter} is not readable by the sandbox's user. Choose: {choices}, or "
        f"reward.sandbox_python: an interpreter outside /root")


def _bwrap_command(spec: SandboxSpec, code: Path, main: str, args: tuple[str, ...],
                   seccomp: int) -> list[str]:
    python = Path(spec.interpreter)
    home = python.parent.parent  # the installation: bin/python3.x under it
    cmd = [shutil.which(spec.bwrap) or spec.bwrap, "--unshare-ipc", "--unshare-pid",
           "--unshare-net", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
           "--new-session", "--seccomp", str(seccomp),
           "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "sbin"):  # merged /usr: symlinks; else read-only binds
        top = Path("/") / name
        if top.is_symlink():
            cmd += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            cmd += ["--ro-bind", str(top), str(top)]
    if not str(home).startswith("/usr/"):
        for parent in reversed(home.parents[:-1]):  # made 0755 and empty: /root stays unseen
            cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", str(home), str(home)]
    # /dev without its pseudo-terminals: bwrap's --dev mounts a devpts instance of its own,
    # whose ptys count against the host's kernel.pty.max (a program holding 256 descriptors in
    # each of its processes could take them all); an empty read-only /dev/pts leaves /dev/ptmx
    # nothing to open (ENOENT), and no program under test needs a terminal
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "0555", "--size", "4096",
            "--tmpfs", "/dev/pts",
            "--perms", "1777", "--size", str(spec.file_mb << 20), "--tmpfs", "/tmp",
            "--ro-bind", str(code), "/sandbox", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--cap-drop", "ALL"]
    if os.geteuid() == 0:  # drop to a user of its own: RLIMIT_NPROC exempts uid 0
        uid = str(SANDBOX_UID_BASE + os.getpid())
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "setpriv",
                "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all", "--"]
    else:
        cmd[1:1] = ["--unshare-user"]
    return [*cmd, str(python), "-I", f"/sandbox/{main}", *args]


def _limits(spec: SandboxSpec, nproc: int, group: cgroups.RunGroup | None):
    # looked up here, called in the child; unsafe isolates nothing (and needs no libseccomp)
    keyring = syscalls.fresh_session_keyring() if spec.mode == OS_SANDBOX else (lambda: None)

    def apply() -> None:  # in the child, before exec
        if group is not None:
            group.join()
        keyring()
        cpu = max(1, int(spec.cpu_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = spec.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        size = spec.file_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _watch(spec: SandboxSpec, cmd: list[str], stdin, nproc: int, cwd: Path | None,
           group: cgroups.RunGroup | None, keep: tuple[int, ...]) -> RunResult:
    """Run ``cmd`` under the limits; read its stdout until it ends or passes the wall clock, the
    output limit or (with a group) the CPU time of its whole tree; end its whole tree either
    way. ``keep``: descriptors the child inherits (bwrap's filter)."""
    start = time.monotonic()
    deadline = start + spec.wall_s
    cap = spec.output_kb << 10
    try:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, preexec_fn=_limits(spec, nproc, group),
                                start_new_session=True, cwd=cwd, env=_env(spec), pass_fds=keep)
    except (OSError, subprocess.SubprocessError) as e:
        return RunResult("sandbox", "", None, f"{type(e).__name__}: {e}")
    out, status = bytearray(), None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            if group is not None and group.cpu_seconds() > spec.cpu_s:
                status = "timeout"  # the tree's CPU time: RLIMIT_CPU bounds each process only
                break
            ready, _, _ = select.select([proc.stdout], [], [], min(left, _POLL_S))
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > cap:
                status = "output"
                break
    finally:
        _end(proc)
    code = proc.returncode
    if status is None and group is not None and group.out_of_memory():
        status = "memory"
    if status is None:
        if code in (-signal.SIGXCPU, -signal.SIGKILL) or code == 128 + signal.SIGXCPU:
            status = "timeout"  # RLIMIT_CPU: SIGXCPU, then SIGKILL at the hard limit
        else:
            status = "ok" if code == 0 else "error"
    detail = "" if status == "ok" else f"exit {code}"
    if status == "error" and spec.mode == OS_SANDBOX and code in (1, 126, 127) and not out:
        detail = f"exit {code} with no output (a program that fails, or the sandbox itself)"
    return RunResult(status, out[:cap].decode("utf-8", "replace"), code, detail,
                     cpu_s=group.cpu_seconds() if group is not None else None,
                     seconds=time.monotonic() - start)


def _end(proc: subprocess.Popen) -> None:
    """The run's whole tree ended: its process group killed (bwrap, whose --die-with-parent
    takes the sandbox's PID namespace with it; unsafe: the program's group), then reaped."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.stdout.close()
    proc.wait()


def _env(spec: SandboxSpec) -> dict[str, str]:
    """The environment bwrap (which clears it for the program) or an unsafe run starts with: no
    secret of the scorer's (keys, tokens) reaches the program."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1"}


_ORPHAN_AGE_S = 600.0
"""A dead worker's host directory made in another PID namespace (whose pids this one cannot
see), or named without one, is removed once it is this old (a run lasts at most
reward.sandbox_program_s)."""
_cleaned = False
"""Whether this process removed what dead workers left (its first run does)."""
HOST_PREFIX = "mugrpo-sandbox-"
"""A run's host directory: ``<tmp>/mugrpo-sandbox-<worker pid>.<its PID namespace>-<random>``."""


def _pid_namespace() -> int:
    """This process's PID namespace (its inode): a directory named with it and a dead pid is a
    dead worker's for certain."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
_POLL_S = 0.1
"""How often the watcher reads the tree's CPU time (a run may overrun sandbox_cpu_s by this
times its processes)."""


def remove_orphans() -> list[Path]:
    """What scoring workers killed mid-run left (each worker cleans up after its own runs):
    their host directories (the program and its input) and their control groups, where the
    worker's pid is no longer alive: at once where the directory names this PID namespace,
    else once it is over ``_ORPHAN_AGE_S`` old (a temporary directory shared with another PID
    namespace holds runs whose pids this one cannot see). Returns the directories and groups
    removed. Called at a worker's first run and when a pool of workers closes (a worker ended by
    a signal or ``os._exit`` runs no exit handler)."""
    gone = []
    here = str(_pid_namespace())
    for d in Path(tempfile.gettempdir()).glob(f"{HOST_PREFIX}*"):
        pid, _, namespace = d.name[len(HOST_PREFIX):].split("-")[0].partition(".")
        try:
            old = namespace == here or time.time() - d.stat().st_mtime > _ORPHAN_AGE_S
        except OSError:
            continue
        if old and d.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone + cgroups.remove_orphans()


def _shortfalls(spec: SandboxSpec) -> list[str]:
    """What the sandbox cannot bound on this machine, in words."""
    group = cgroups.RunGroup.create(spec.memory_mb << 20)
    if group is not None:
        group.remove()
        return []
    return [f"reward.sandbox: the scorer may not create control groups here (neither a "
            f"delegated cgroup v2 subtree nor writable v1 memory/cpuacct hierarchies; run "
            f"as root, or under a systemd unit with Delegate=yes), so a program's memory and CPU "
            f"are bounded per process only: up to reward.sandbox_processes x sandbox_memory_mb "
            f"= {spec.processes * spec.memory_mb} MB of address space and "
            f"{spec.processes} x sandbox_cpu_s of CPU a run, and the kernel memory of its tmpfs "
            f"files within sandbox_file_mb's bytes but not its count of files"]


def _user_tasks() -> int:
    """Tasks (threads) this user runs now, which ``RLIMIT_NPROC`` counts for a non-root user:
    the limit is set this many above it."""
    uid, n = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    n += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return n

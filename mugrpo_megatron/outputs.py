"""Writing outputs without destroying what a user did not ask to replace.

Every command that writes a directory (convert both ways, the HF export, learner checkpoints)
writes it whole into a staging directory beside the destination, ``.NAME.mugrpo-partial``, and renames
it into place only once it is complete: a reader never sees a half-written output under the
destination's name, and a crash leaves the destination as it was.

- ``check_destination`` runs before any work (and before any process group exists): it refuses a
  destination that is, or contains, one of the command's inputs, and a destination that exists
  and is not an empty directory unless the user passed ``--overwrite``.
- ``begin`` / ``commit`` stage and publish (rank 0 only; collective writers put a barrier
  between them). With an existing destination, ``commit`` moves it aside to ``.NAME.replaced``,
  renames the new one in, then deletes the old: between the two renames a crash leaves the old
  output whole under ``.NAME.replaced``.

Only directories of those two names (this module's own) are ever removed by it: a stale staging
directory left by a crash is cleared before the next attempt.

A write that fails for want of space (``out_of_space``: ENOSPC, EDQUOT, or torch's zip writer's
"unexpected pos", which is how ``torch.save`` reports a full disk) becomes a ``DiskFull`` error
that names the path, the space left on its file system, what was kept, and how to go on
(``disk_full``, ``guard``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path


class OutputExists(ValueError):
    """The destination holds something the user did not ask to replace."""


def _resolved(p: str | Path) -> Path:
    return Path(os.path.abspath(os.path.realpath(p)))


def check_destination(out: str | Path, inputs: Sequence[str | Path] = (), *, overwrite: bool,
                      flag: str = "--overwrite", what: str = "--out", directory: bool = True) -> None:
    """Refuse to write ``out`` (a directory, or with ``directory=False`` a file) where that would
    destroy something: ValueError naming why."""
    dest = _resolved(out)
    for src in inputs:
        src_path = _resolved(src)
        if dest == src_path or dest in src_path.parents:
            raise ValueError(f"{what}: {out} is or contains the input {src}; writing there would "
                             f"destroy it. Choose another destination.")
    if not os.path.lexists(out):
        return
    if Path(out).is_dir() != directory:
        raise ValueError(f"{what}: {out} is " + ("a file, not a directory" if directory else
                         "a directory, not a file") + "; remove it yourself if it should go")
    if directory and not any(Path(out).iterdir()):
        return
    if not overwrite:
        kind = "directory" if directory else "file"
        raise OutputExists(f"{what}: {out} is an existing, non-empty {kind}; nothing was written. "
                           f"Pass {flag} to replace it (the new output is written beside it and "
                           f"renamed into place once complete), or choose another destination.")


def staging_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(f".{out.name}.mugrpo-partial")


def begin(out: str | Path) -> Path:
    """A fresh, empty staging directory for ``out`` (call on one rank; the others find it with
    ``staging_path``). A stale one, left by a crash, is cleared."""
    tmp = staging_path(out)
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(out: str | Path, tmp: str | Path | None = None) -> Path:
    """Publish the complete staging directory as ``out``, replacing what is there (whose
    replacement ``check_destination`` allowed before the work began)."""
    out, tmp = Path(out), Path(tmp) if tmp is not None else staging_path(out)
    _fsync_dir(tmp)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    old = move_aside(out) if os.path.lexists(out) else None
    tmp.rename(out)
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)
    return out


def move_aside(out: str | Path) -> Path:
    """Rename ``out`` to ``.NAME.mugrpo-replaced`` beside it (one rename: until the caller deletes
    it, the old output is whole there) and return that path."""
    out = Path(out)
    old = out.with_name(f".{out.name}.mugrpo-replaced")
    if os.path.lexists(old):
        shutil.rmtree(old)  # our own leftover: the output it held was replaced by a later commit
    out.rename(old)
    return old


def write_file(path: str | Path, data: str) -> None:
    """Write a small file atomically (a temporary file beside it, fsynced, renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.mugrpo-partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


KEPT = ("every checkpoint, rollout shard and metric already in the run directory is whole (what "
        "was being written never took its final name)")
"""What a training run keeps when a write fails: every file is written beside its name, then
renamed."""
RESUME = ("run the same command again: the run resumes from its last checkpoint and reuses the "
          "rollouts already on disk")


class DiskFull(RuntimeError):
    """A write failed for want of space; the message says where, what was kept, what to do."""


class RunFailed(RuntimeError):
    """A failure that ends a training run; the message says what was kept and how to resume."""


_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "unexpected pos",
              "PytorchStreamWriter failed writing")


def out_of_space(error: BaseException) -> bool:
    """Whether ``error`` is a write that failed because the file system (or a quota) is full."""
    if isinstance(error, DiskFull):
        return True
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # other writers say it in words: pyarrow's and torch's (RuntimeError), safetensors' own
    text = str(error)
    return isinstance(error, Exception) and any(t in text for t in _FULL_TEXT)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Free space on the file system that holds (or would hold) ``path``."""
    return shutil.disk_usage(_existing(Path(path).absolute())).free


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def disk_full(path: str | Path, what: str, error: BaseException | None, *, kept: str,
              then: str, needed: int | None = None) -> DiskFull:
    """The ``DiskFull`` error for a failed write of ``what`` at ``path``."""
    usage = shutil.disk_usage(_existing(Path(path).absolute()))
    cause = f" ({type(error).__name__}: {str(error)[:300]})" if error is not None else ""
    need = f"; it needs about {_size(needed)}" if needed else ""
    return DiskFull(
        f"{what}: no space left to write {path}: its file system has {_size(usage.free)} free "
        f"of {_size(usage.total)} (a quota may allow less){need}{cause}. Nothing persisted was "
        f"lost: {kept}. Free some space or raise the quota, then {then}.")


@contextlib.contextmanager
def guard(path: str | Path, what: str, *, kept: str, then: str) -> Iterator[None]:
    """Inside, a write that fails for want of space raises ``disk_full``'s error instead."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if not out_of_space(e):
            raise
        raise disk_full(path, what, e, kept=kept, then=then) from e

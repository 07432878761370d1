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
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
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

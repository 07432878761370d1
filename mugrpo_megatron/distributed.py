"""The job's default process group and the few things every part does with it (torch.distributed
only: no megatron here).

``init_default_group`` starts it (NCCL on GPUs, gloo on CPU) with ``parallel.timeout_minutes``;
megatron-core's groups (``learner.model.init_parallel``) and the engines' groups get the same
timeout, so a rank that waits for a slow or dead peer gives up after that long, everywhere.
Under torchrun it runs first, before anything reads the run directory or builds a model, so that
the ranks can agree on both (``run_dir.agree``) before an hour of work.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

TIMEOUT_KEY = "parallel.timeout_minutes"
_timeout_minutes = 30.0
"""The default group's collective timeout (``init_default_group``)."""


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when no process group exists."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_default_group(timeout_minutes: float) -> None:
    """Start torch.distributed's default group (once; a no-op when it exists): NCCL on GPUs, gloo
    on CPU, with ``timeout_minutes`` for every collective on it. Works under torchrun and in a
    plain single process (world size 1)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a plain process (world size 1): any free port
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    global _timeout_minutes
    _timeout_minutes = timeout_minutes


def leave() -> None:
    """Destroy the default group (and every group under it) at the end of a run that finished:
    torch asks for it before exit (2.4+: NCCL's communicators leak, and its destructor warns,
    without it), and a gloo group left to the interpreter's teardown can abort the process after
    its work is done ("terminate called without an active exception"). Only where every rank
    finished in step: after a collective timed out, destroying may wait on the rank that stopped."""
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    """This rank's device: its GPU (``LOCAL_RANK``'s, set by ``init_default_group``) or the CPU.
    Also where the tensors of every collective of the job live: the default group is NCCL where
    there is a GPU, which takes CUDA tensors only, and gloo elsewhere."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host() -> str:
    return socket.gethostname()


def agree(error: str) -> str:
    """The failing ranks' errors on every rank ('' when none failed). Collective: what ends
    work that ranks did on their own, so that one rank's failure makes every rank raise the same
    error instead of leaving the others waiting in a collective. One rank's error alone is
    given as it is; several are named by rank, up to three different ones (the others that
    failed the same way counted), so that a rank's cause is not hidden behind another's
    timeout that it caused."""
    _, size = world()
    if size == 1:
        return error
    errors: list = [None] * size
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if len(failed) <= 1:
        return failed[0][1] if failed else ""
    by_error: dict[str, list[int]] = {}
    for r, e in failed:
        by_error.setdefault(e, []).append(r)
    parts = [f"rank {ranks[0]}{f' (and {len(ranks) - 1} more)' if len(ranks) > 1 else ''}: {e}"
             for e, ranks in list(by_error.items())[:3]]
    rest = len(by_error) - 3
    return "; ".join(parts) + (f"; and {rest} other errors" if rest > 0 else "")


class Failure:
    """The first error of work a rank does on its own (``agreed``)."""

    def __init__(self):
        self.error = ""

    def record(self, error: BaseException, what: str = "") -> None:
        if not self.error:
            self.error = f"{what}{type(error).__name__}: {error}"

    @contextlib.contextmanager
    def kept(self, what: str = "") -> Iterator[None]:
        """Inside, an exception is recorded instead of raised: work that must go on in step with
        other ranks (a replica's engine stepping with its tensor-parallel peers) goes on."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - recorded, agreed on at the end of agreed()
            if is_collective_timeout(e):
                raise  # the ranks are out of step: no agreement can follow
            self.record(e, what)


class Stalled(RuntimeError):
    """Ranks that had not finished their own work made no progress for the timeout."""


class Arrival:
    """Ranks that finish work of their own at different times (a phase's generation: one
    replica's refill rounds while the others are done) wait for each other on the host, in the
    default group's key-value store, not in a collective: no NCCL operation is pending while
    they wait, so the watchdog (``parallel.timeout_minutes``) cannot end a wait that is only
    long. A wait ends when every rank has arrived; it fails (``Stalled``, naming the ranks not
    arrived) only when those ranks made no progress (``beat``: each finished unit of work, sent
    at most every ``BEAT_SECONDS``) for ``stall_minutes`` (default: the collective timeout).
    Keys: ``mugrpo/<tag>/...``, a few a rank, in the store torchrun's rendezvous made. Cost at
    64 ranks: a working rank sends one add every BEAT_SECONDS; a done one polls every
    POLL_SECONDS (a check of 64 keys and one add): ~260 small requests a second to the store's
    host in a generation's tail, none otherwise; 65 keys a generation, whatever its size."""

    BEAT_SECONDS = 5.0
    POLL_SECONDS = 0.5

    def __init__(self, tag: str, stall_minutes: float | None = None):
        from mugrpo_megatron.engines.compat_torch import default_store

        self.rank, self.size = world()
        self.tag, self.stall_s = f"mugrpo/{tag}", 60 * (stall_minutes or _timeout_minutes)
        self.store = default_store() if self.size > 1 else None
        self._beats, self._sent = 0, 0.0

    def beat(self) -> None:
        """A unit of this rank's work done (cheap: the store is told every BEAT_SECONDS)."""
        self._beats += 1
        if self.store is not None and time.monotonic() - self._sent >= self.BEAT_SECONDS:
            self.store.add(f"{self.tag}/beats", self._beats)
            self._beats, self._sent = 0, time.monotonic()

    def wait(self) -> None:
        """Arrive, then wait for every rank (``Stalled`` after ``stall_minutes`` without a
        beat from any rank still working)."""
        if self.store is None:
            return
        self.store.add(f"{self.tag}/beats", self._beats)
        self.store.set(f"{self.tag}/done/{self.rank}", "1")
        keys = [f"{self.tag}/done/{r}" for r in range(self.size)]
        seen, since = -1, time.monotonic()
        while not self.store.check(keys):
            beats = self.store.add(f"{self.tag}/beats", 0)
            if beats != seen:
                seen, since = beats, time.monotonic()
            elif time.monotonic() - since > self.stall_s:
                late = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise Stalled(f"ranks {late} had not finished their work and made no progress "
                              f"for {self.stall_s / 60:g} minutes ({TIMEOUT_KEY}): frozen or "
                              f"dead (see their logs); everything persisted was kept, run the "
                              f"same command again to resume")
            time.sleep(self.POLL_SECONDS)


@contextlib.contextmanager
def agreed(raise_as: type[Exception] = RuntimeError,
           explain: Callable[[str], str] = lambda error: error,
           arrival: Arrival | None = None) -> Iterator[Failure]:
    """Collective, around work that ranks do on their own: the block's failure (raised, or
    recorded through the ``Failure`` it yields) and every other rank's are agreed on when it
    ends, and every rank raises ``raise_as(explain(first failing rank's message))``, or none
    does. One small all-gather (``agree``) at the end; nothing inside waits for another rank.
    ``arrival``: the ranks first wait for each other on the host (``Arrival``), so that the
    all-gather starts when all are there, however long the slowest one's work ran."""
    failure = Failure()
    try:
        yield failure
    except Exception as e:  # noqa: BLE001 - agreed on below, raised on every rank
        if is_collective_timeout(e):
            raise  # the ranks are out of step: an agreement would wait as long again
        failure.record(e)
    if arrival is not None:
        arrival.wait()
    error = agree(failure.error)
    if error:
        raise raise_as(explain(error))


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that gave up waiting for a peer (gloo raises it; NCCL's
    watchdog aborts the process itself, after printing its own 'Timeout(ms)=' line)."""
    text = str(error)  # gloo: "... Timed out waiting 60000ms for recv operation to complete"
    return isinstance(error, RuntimeError) and ("Timed out waiting" in text
                                                or "collective operation timeout" in text)


def timeout_explanation(timeout_minutes: float) -> str:
    """What a user reads when a collective timed out."""
    return (f"a collective operation waited longer than {TIMEOUT_KEY} = {timeout_minutes:g} "
            f"minutes for another rank, so this rank stopped. A rank that is frozen, crashed or "
            f"cut off (see the other ranks' logs) causes this; so does work on some ranks that "
            f"takes longer than the timeout while the others wait (a phase's generation, an "
            f"evaluation): then raise {TIMEOUT_KEY}. Everything persisted in the run directory "
            f"was kept; run the same command again to resume.")


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank (a decision it took, a path it chose): the one way a value
    goes from rank 0 to the others. Collective: one ``broadcast_object_list`` (a pickle of
    ``obj``: for small values, never a phase's data); nothing when the world has one rank."""
    _, size = world()
    if size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on rank 0 only, and its result on every rank (``from_rank0``).
    Collective: if it raises, every rank raises (rank 0 the original error, the others a
    ``RemoteFailure`` with its message), so that no rank is left waiting in the collective that
    follows."""
    rank, _ = world()
    result = None
    if rank == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            agree(f"{type(e).__name__}: {e}")
            raise
        agree("")
    elif error := agree(""):
        raise RemoteFailure(f"rank 0 failed: {error}")
    return from_rank0(result)


class RemoteFailure(RuntimeError):
    """Another rank failed in work it did alone; its message says how."""

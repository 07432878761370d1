"""distributed.agreed, the one way work that ranks do on their own ends: on 2 gloo ranks, one
rank's failure is raised on every rank, work kept going inside Failure.kept stays in step with
the other ranks' collectives, no failure raises nothing, and a collective timeout passes through
untouched (the ranks are out of step: waiting for an agreement would take as long again)."""

import json
from pathlib import Path

import pytest
from helpers import gloo_world, spawn_ranks


def _rank(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mugrpo_megatron.distributed import agreed

    gloo_world(rank, 2, out, minutes=5)
    seen: dict[str, str] = {}

    def case(name, body, explain=lambda e: e):
        try:
            with agreed(ValueError, explain) as failure:
                body(failure)
            seen[name] = "none"
        except ValueError as e:
            seen[name] = f"ValueError: {e}"
        except RuntimeError as e:
            seen[name] = f"RuntimeError: {e}"

    def raises_on_rank1(_):
        if rank == 1:
            raise KeyError("boom")

    def kept_then_collective(failure):
        with failure.kept("writing: "):
            if rank == 0:
                raise OSError("disk")
        t = torch.ones(1)
        dist.all_reduce(t)  # both ranks still reach it
        seen["sum"] = str(int(t))

    def timed_out(_):
        raise RuntimeError("[gloo] Timed out waiting 60000ms for recv operation to complete")

    case("one_rank", raises_on_rank1, "sync failed: {}".format)
    case("kept", kept_then_collective)
    case("clean", lambda _: None)
    case("timeout", timed_out)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_failures_are_agreed_on_every_rank(tmp_path):
    assert spawn_ranks(_rank, str(tmp_path), timeout=300) == [0, 0]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for s in seen:
        assert s["one_rank"] == "ValueError: sync failed: KeyError: 'boom'", s
        assert s["kept"] == "ValueError: writing: OSError: disk" and s["sum"] == "2", s
        assert s["clean"] == "none"
        assert s["timeout"].startswith("RuntimeError: [gloo] Timed out waiting"), s


def _late_replica(rank: int, directory: str, frozen: bool) -> None:
    """Three ranks under a 3-second collective timeout; rank 2 works 8 s alone (beating every
    0.2 s, or frozen: no beat), ranks 0 and 1 are done at once and agree after ``Arrival``."""
    import time

    import torch.distributed as dist

    from mugrpo_megatron.distributed import Arrival, Stalled, agreed

    gloo_world(rank, 3, directory, minutes=3 / 60)
    Arrival.BEAT_SECONDS, Arrival.POLL_SECONDS = 0.2, 0.1
    arrival = Arrival("generate/0/0", stall_minutes=2 / 60)
    try:
        with agreed(RuntimeError, arrival=arrival):
            if rank == 2:
                for _ in range(40):
                    time.sleep(0.2)
                    if not frozen:
                        arrival.beat()
    except Stalled as e:
        ok = frozen and rank != 2 and "ranks [2] had not finished" in str(e)
        _leave(0 if ok else 4)
    except RuntimeError:  # the frozen rank, late: the others had given up (a timeout, or a
        _leave(0 if frozen and rank == 2 else 5)  # closed connection)
    dist.destroy_process_group()
    raise SystemExit(3 if frozen else 0)


def _leave(code: int) -> None:
    """Exit with ``code`` at once, past the interpreter's teardown: a rank whose gloo group broke
    (a peer gone, a timed-out collective) may abort in the group's destructor ("terminate called
    without an active exception", SIGABRT) on a loaded machine; the code is what the test checks."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@pytest.mark.parametrize("frozen", [False, True])
def test_ranks_done_early_wait_for_a_slow_one_outside_any_collective(tmp_path, frozen):
    """A rank working past the collective timeout while the others are done (a replica's
    refill rounds): the others wait in the store, not in a collective, so the agreement after
    it succeeds (without the wait the all-gather times out after 3 s, as the frozen case shows
    for the late rank). A rank that makes no progress for the stall limit is named."""
    assert spawn_ranks(_late_replica, str(tmp_path), frozen, ranks=3, timeout=120) == [0, 0, 0]


def test_a_finished_run_leaves_no_group_behind():
    """``distributed.leave``: the default group destroyed (torch asks for it before exit), and
    a no-op where there is none."""
    import torch.distributed as dist

    from mugrpo_megatron import distributed

    distributed.leave()  # none yet
    distributed.init_default_group(1)
    assert dist.is_initialized()
    distributed.leave()
    assert not dist.is_initialized()

"""distributed.agreed, the one way work that ranks do on their own ends: on 2 gloo ranks, one
rank's failure is raised on every rank, work kept going inside Failure.kept stays in step with
the other ranks' collectives, no failure raises nothing, and a collective timeout passes through
untouched (the ranks are out of step: waiting for an agreement would take as long again)."""

import json
from pathlib import Path

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

"""Learner checkpoints: resume in another TP/PP/DP layout gives the update the uninterrupted run
takes, and a checkpoint saved before any update (no optimizer state yet) resumes too."""

import json

import pytest
import torch
from helpers import ROOT, make_batch, torchrun
from safetensors.torch import load_file

from mugrpo_megatron.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "dist" / "ckpt_worker.py"
# Adam's eps = 1.0 makes an update proportional to the gradient, so a lost or wrong moment shows
COMMON = ["parallel.micro_batch_size=2", "algo.samples_per_update=8", "algo.total_updates=8",
          "algo.updates_per_phase=4", "optim.lr=0.1", "optim.adam_eps=1.0", "optim.grad_clip=1.0",
          "optim.warmup_updates=2"]
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["parallel.tensor=2"]), "pp2": (2, ["parallel.pipeline=2"]),
           "dp2": (2, []), "cp2": (2, ["parallel.context=2"])}


BF16 = ["model.dtype=bfloat16"]
# Every run the tests read: name -> (mode, layout, updates before the save, checkpoint read or
# written, extra overrides). Saves come first; a load reads a save's checkpoint.
JOBS = {
    "saved_2": ("save", "tp2", 2, "ckpt_2", []),  # the uninterrupted runs, saved in TP2
    "saved_0": ("save", "tp2", 0, "ckpt_0", []),
    "saved_cp2": ("save", "cp2", 2, "ckpt_cp2", []),
    "saved_dp2": ("save", "dp2", 2, "ckpt_dp2", []),
    "saved_bf16": ("save", "dp2", 2, "ckpt_bf16", BF16),
    **{f"resaved_{layout}": ("resave", layout, 2, "ckpt_2", []) for layout in ("tp1", "pp2", "dp2",
                                                                              "cp2")},
    **{f"resumed_2_{layout}": ("resume", layout, 2, "ckpt_2", []) for layout in ("tp1", "pp2",
                                                                                "dp2", "cp2")},
    **{f"resumed_0_{layout}": ("resume", layout, 0, "ckpt_0", []) for layout in ("tp1", "pp2",
                                                                                "dp2")},
    "resumed_cp2_tp1": ("resume", "tp1", 2, "ckpt_cp2", []),
    "resaved_bf16": ("resave", "tp2", 2, "ckpt_bf16", BF16),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Every run of ``JOBS``, in three launches (start-up is most of a run's cost): the saves
    at 2 ranks, then the loads at 1 rank and at 2."""
    d = tmp_path_factory.mktemp("ckpt")
    make_batch(d / "batch.safetensors")
    hf = make_tiny_checkpoint(d / "hf", "qwen2", seed=2, tie_embeddings=True)
    for saves, nproc in ((True, 2), (False, 1), (False, 2)):
        todo = [{"mode": mode, "ckpt": str(d / ckpt), "out": str(d / name), "steps": steps,
                 "overrides": [f"model.path={hf}", *COMMON, *LAYOUTS[layout][1], *extra]}
                for name, (mode, layout, steps, ckpt, extra) in JOBS.items()
                if (mode == "save") == saves and LAYOUTS[layout][0] == nproc]
        spec = d / f"{'saves' if saves else 'loads'}_{nproc}.json"
        spec.write_text(json.dumps(todo))
        torchrun(nproc, WORKER, str(d / "batch.safetensors"), str(spec), timeout=300 * len(todo))
    return d, hf


def result(setup, name):
    """The weights after the last update and result.json of run ``name`` of ``JOBS``."""
    out = setup[0] / name
    return load_file(str(out / "weights.safetensors")), json.loads((out / "result.json").read_text())


def full_state(ckpt, tmp):
    """Every tensor of a checkpoint, unsharded (DCP's own converter, no process group), and the
    optimizer's param groups (whose 'step' is Adam's step count)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp)
    full = torch.load(tmp, weights_only=False)
    # the common state: common.pt (megatron-core 0.16) or a bytes item of the DCP files (0.19)
    common = torch.load(ckpt / "common.pt", weights_only=True) if (ckpt / "common.pt").exists() \
        else full["common_state/shard_0_1"][0]
    return full, common["optimizer"]["optimizer"]["param_groups"]


def test_optimizer_state_survives_a_layout_change_bit_for_bit(setup):
    """Adam's moments, the fp32 master weights and the step count, saved in TP2 after 2 updates,
    loaded into TP1 / PP2 / DP2 and saved again, are the same bits (AReaL#1468: a megatron-core
    release that loaded a checkpoint and silently dropped the Adam moments)."""
    d, _ = setup
    ref, ref_groups = full_state(d / "ckpt_2", d / "ref.pt")
    optim = {k: v for k, v in ref.items() if k.startswith("optimizer.state.")}
    # the model-space layout: fp32 master weights and both moments of every parameter, written
    # by the ranks that hold them (no rank gathered another's)
    assert {k.split(".")[2] for k in optim} == {"fp32_param", "exp_avg", "exp_avg_sq"}
    assert all(v.abs().sum() > 0 for k, v in optim.items() if ".exp_avg" in k)  # two real steps
    assert {g["step"] for g in ref_groups} == {2}
    for layout in ("tp1", "pp2", "dp2", "cp2"):
        got, groups = full_state(d / f"resaved_{layout}" / "ckpt", d / f"{layout}.pt")
        assert [g["step"] for g in groups] == [g["step"] for g in ref_groups], layout
        for k, v in optim.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (layout, k)


@pytest.mark.parametrize("steps", [2, 0])
def test_resume_in_another_layout(setup, steps):
    ref_w, ref = result(setup, f"saved_{steps}")
    for layout in ("tp1", "pp2", "dp2", *(("cp2",) if steps else ())):  # CP: once is enough
        got_w, got = result(setup, f"resumed_{steps}_{layout}")
        assert got["losses"][-1] == pytest.approx(ref["losses"][-1], abs=1e-6), layout
        assert got["lr"] == pytest.approx(ref["lr"]), layout  # the LR schedule resumed too
        for name, w in ref_w.items():
            assert torch.allclose(got_w[name], w, atol=1e-5), (layout, name)


def test_a_checkpoint_saved_at_cp2_resumes_at_cp1(setup):
    """Saved with each sequence split over two context-parallel ranks (the distributed
    optimizer sharded over DP x CP) after 2 updates, resumed in one rank: the next update's
    loss, the LR and the weights are the TP2-saved run's (the reverse, TP2 into CP2, is above)."""
    ref_w, ref = result(setup, "saved_2")
    got_w, got = result(setup, "resumed_cp2_tp1")
    assert got["losses"][-1] == pytest.approx(ref["losses"][-1], abs=1e-6)
    assert got["lr"] == pytest.approx(ref["lr"])
    for name, w in ref_w.items():
        assert torch.allclose(got_w[name], w, atol=1e-5), name


def test_each_rank_writes_only_its_own_optimizer_shard(setup):
    """At DP2 with the distributed optimizer, each rank writes its own half of the optimizer
    state and nothing of the other's: no rank gathered the whole TP x PP shard's state in host
    memory to save it (megatron's fully_reshardable layout did, on every rank, and had DP rank
    0 write all of it; at 70B that was ~55 GiB a rank). benchmarks/save_memory.py measures the
    memory; this checks the rule in the checkpoint's own index."""
    from torch.distributed.checkpoint import FileSystemReader

    d, _ = setup
    meta = FileSystemReader(str(d / "ckpt_dp2")).read_metadata()
    written: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("optimizer.state."):
            written[info.relative_path] = written.get(info.relative_path, 0) + info.length
    by_rank: dict[int, int] = {}  # files are named __<rank>_<i>.distcp
    for name, n in written.items():
        rank = int(name.removeprefix("__").split("_")[0])
        by_rank[rank] = by_rank.get(rank, 0) + n
    assert sorted(by_rank) == [0, 1], written
    assert max(by_rank.values()) < 0.6 * sum(by_rank.values()), by_rank


def test_bf16_optimizer_state_survives_a_layout_change_bit_for_bit(setup):
    """The same in bf16 training, where the distributed optimizer's fp32 master weights are
    tensors of their own beside the bf16 model (in fp32 training they are the model's): saved
    at DP2 (each rank its half of the state, the model-space layout as compat_megatron part 5
    describes its ranges) and saved again at TP2, the master weights and both moments are the
    same bits, and the saved bf16 weights are the master weights rounded."""
    d, _ = setup
    ref, ref_groups = full_state(d / "ckpt_bf16", d / "bf16_ref.pt")
    got, groups = full_state(d / "resaved_bf16" / "ckpt", d / "bf16_got.pt")
    optim = {k: v for k, v in ref.items() if k.startswith("optimizer.state.")}
    assert {k.split(".")[2] for k in optim} == {"fp32_param", "exp_avg", "exp_avg_sq"}
    assert {g["step"] for g in ref_groups} == {2} and [g["step"] for g in groups] == \
        [g["step"] for g in ref_groups]
    for k, v in optim.items():
        assert v.dtype == torch.float32 and got[k].dtype == v.dtype and torch.equal(got[k], v), k
    masters = {k.removeprefix("optimizer.state.fp32_param."): v for k, v in optim.items()
               if k.startswith("optimizer.state.fp32_param.")}
    model = {k: v for k, v in ref.items() if k in masters}
    assert model and len(model) == len(masters), sorted(ref)[:10]
    for k, w in model.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, masters[k].to(torch.bfloat16)), k
        assert torch.equal(got[k], w), k

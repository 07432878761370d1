"""`python -m mugrpo_megatron rollouts`: the summary equals a naive count over the samples, the
samples shown are decoded, and a missing phase or run directory is named."""

import random
import re

import pytest

from mugrpo_megatron.__main__ import main
from mugrpo_megatron.engines.base import Generation
from mugrpo_megatron.models.tiny import make_tokenizer
from mugrpo_megatron.phase.data import PhaseData
from mugrpo_megatron.phase.store import Advantages, ScoredGroup, finalize, phase_dir, write_shard
from mugrpo_megatron.phase.viewer import phase_files, show, summarize


def groups(n_groups=40, g=4, seed=0):
    rng = random.Random(seed)
    out = []
    for grp in range(n_groups):
        uniform = grp % 5 == 0
        gens = []
        for _ in range(g):
            n = rng.randint(0, 30)
            gens.append(Generation(tuple(rng.randint(10, 300) for _ in range(n)), (-1.0,) * n,
                                   rng.choice(["stop", "length"])))
        out.append(ScoredGroup.of(grp, 100 + grp, (5, 6, 7), gens,
                               [1.0 if uniform else float(rng.random() < 0.5) for _ in range(g)]))
    return out


def test_summary_equals_a_naive_count(tmp_path):
    gs = groups()
    d = phase_dir(tmp_path, 0)
    for k in range(0, 40, 9):
        write_shard(d, gs[k:k + 9][::-1])
    files, complete = phase_files(tmp_path, 0)
    assert len(files) == 5 and not complete
    s = summarize(files, complete)
    rows = [(g.position, len(x), f, r) for g in gs
            for x, f, r in zip(g.responses, g.finish_reasons, g.rewards)]
    assert s.num_samples == len(rows)
    assert s.reward_sum == pytest.approx(sum(r for *_, r in rows))
    assert s.length_sum == sum(n for _, n, _, _ in rows)
    assert s.length_max == max(n for _, n, _, _ in rows)
    assert s.finish == {k: sum(f == k for _, _, f, _ in rows) for k in ("stop", "length")}
    naive_uniform = sum(len(set(g.rewards)) == 1 for g in gs)
    assert f"uniform groups {naive_uniform} " in s.text(0)
    finalize(d, 40, 4, Advantages())
    files, complete = phase_files(tmp_path, 0)
    assert complete
    s = summarize(files, complete)
    adv = PhaseData(d, drop_uniform=False).advantage
    assert s.adv_neg == int((adv < 0).sum())
    assert s.adv_abs_sum == pytest.approx(float(abs(adv).sum()))


def test_show_decodes_the_samples_it_picks(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    ids = tuple(tok("The answer is \\boxed{19}.")["input_ids"])
    prompt = tuple(tok("What is 12 + 7?")["input_ids"])
    gs = [ScoredGroup.of(k, 2 * k, prompt, [Generation(ids, (-0.5,) * len(ids), "stop")] * 2,
                      [1.0, 0.0]) for k in range(4)]
    d = phase_dir(tmp_path, 0)
    write_shard(d, gs[2:])
    write_shard(d, gs[:2])
    finalize(d, 4, 2, Advantages())
    text = show(tmp_path, 0, 2, tok)
    assert text.count("[response] The answer is \\boxed{19}.") == 2
    assert text.count("[prompt] What is 12 + 7?") == 2
    # row 5 of the phase: group 2's second sample (reward 0 of (1, 0): advantage -1/sqrt(2))
    text = show(tmp_path, 0, 8, tok)
    assert re.search(r"sample 5: prompt row 4, group 2, reward 0.000, advantage -0.707", text), text


def test_missing_phase_and_run_dir_are_named(tmp_path, capsys):
    write_shard(phase_dir(tmp_path, 0), groups(2))
    assert main(["rollouts", str(tmp_path), "--phase", "3"]) == 2
    assert "no rollouts for phase 3 (phases on disk: phase_0000)" in capsys.readouterr().err
    assert main(["rollouts", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["rollouts", str(tmp_path), "--ids", "--show", "1"]) == 0
    assert "generation not finished" in capsys.readouterr().out

"""`python -m mugrpo_megatron rollouts`: the summary equals a naive count over the samples, the
samples shown are decoded, and a missing phase or run directory is named."""

import random
import re

import pytest

from mugrpo_megatron.__main__ import main
from mugrpo_megatron.inspect_rollouts import phase_files, show, summarize
from mugrpo_megatron.rollout import Sample, with_advantages
from mugrpo_megatron.rollout_store import RolloutStore
from mugrpo_megatron.tiny import make_tokenizer


def samples(n_groups=40, g=4, seed=0):
    rng = random.Random(seed)
    out = []
    for grp in range(n_groups):
        uniform = grp % 5 == 0
        for _ in range(g):
            n = rng.randint(0, 30)
            out.append(Sample(0, 100 + grp, grp, (5, 6, 7), tuple(rng.randint(10, 300) for _ in range(n)),
                              tuple(-1.0 for _ in range(n)), rng.choice(["stop", "length"]),
                              reward=1.0 if uniform else float(rng.random() < 0.5)))
    return out


def test_summary_equals_a_naive_count(tmp_path, monkeypatch):
    import mugrpo_megatron.inspect_rollouts as ir

    monkeypatch.setattr(ir, "_BATCH_ROWS", 7)  # many batches, groups split across them
    rows = with_advantages(samples(), 4, 1e-6)
    store = RolloutStore(tmp_path)
    store.write_part(0, 0, rows[:50])
    store.write_part(0, 1, rows[50:])
    files, complete = phase_files(tmp_path, 0)
    assert len(files) == 2 and not complete
    s = summarize(files, complete)
    assert s.num_samples == len(rows)
    assert s.reward_sum == pytest.approx(sum(r.reward for r in rows))
    assert s.length_sum == sum(len(r.response_ids) for r in rows)
    assert s.length_max == max(len(r.response_ids) for r in rows)
    assert s.finish == {k: sum(r.finish_reason == k for r in rows) for k in ("stop", "length")}
    naive_uniform = sum(len({r.reward for r in rows if r.group == g}) == 1 for g in range(40))
    assert f"uniform groups {naive_uniform} " in s.text(0)
    store.write_final(0, rows)
    files, complete = phase_files(tmp_path, 0)
    assert [f.name for f in files] == ["final.parquet"] and complete
    s = summarize(files, complete)
    assert s.adv_neg == sum(r.advantage < 0 for r in rows)
    assert s.adv_abs_sum == pytest.approx(sum(abs(r.advantage) for r in rows))


def test_show_decodes_the_samples_it_picks(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    ids = tuple(tok("The answer is \\boxed{19}.")["input_ids"])
    rows = [Sample(0, i, i // 2, tuple(tok("What is 12 + 7?")["input_ids"]), ids, (-0.5,) * len(ids),
                   "stop", reward=float(i % 2)) for i in range(8)]
    RolloutStore(tmp_path).write_final(0, with_advantages(rows, 2, 1e-6))
    text = show(tmp_path, 0, 2, tok)
    assert text.count("[response] The answer is \\boxed{19}.") == 2
    assert text.count("[prompt] What is 12 + 7?") == 2
    assert re.search(r"sample 4: prompt row 4, group 2, reward 0.000, advantage -0.707", text), text


def test_missing_phase_and_run_dir_are_named(tmp_path, capsys):
    RolloutStore(tmp_path).write_part(0, 0, samples(2))
    assert main(["rollouts", str(tmp_path), "--phase", "3"]) == 2
    assert "no rollouts for phase 3 (phases on disk: phase_0000)" in capsys.readouterr().err
    assert main(["rollouts", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["rollouts", str(tmp_path), "--ids", "--show", "1"]) == 0
    assert "generation not finished" in capsys.readouterr().out

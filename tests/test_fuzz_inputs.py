"""Fuzz-style checks of the two paths that take outside input: the data loader and the reward.

Random bytes, random JSON and random lengths (seeded, so a failure reproduces). Every case must
end in a clear ValueError, a counted skip, or a score within the scorer's limit: never another
exception, a hang, or a reward outside what the reward's rule allows."""

import json
import random
import time

import pytest

from mugrpo_megatron.config import DataConfig, RewardConfig
from mugrpo_megatron.data import load_prompts
from mugrpo_megatron.rewards import RewardScorer
from mugrpo_megatron.rewards.math_answer import extract_answer

SEED = 20261201
_PIECES = ["\\boxed{", "\\fbox{", "{", "}", "####", "\n", "$", "\\frac{1}{2}", "7", "-3.5", " ",
           "é", "\x00", "\\", "boxed", "\\boxed", "}}", "{{"]


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**63, 1e308, -0.0, 3.25, float("nan")])
    if kind in (3, 4, 5):
        return "".join(rng.choice(_PIECES + ["What is 2+2?", "4"]) for _ in range(rng.randrange(12)))
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["question", "answer", "q", "", "question "]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def random_line(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(60))).replace(b"\n", b" ")
    if kind == 1:  # a well-formed row
        return json.dumps({"question": "What is 2+2?", "answer": rng.choice(["4", 4, "4.0"])}).encode()
    if kind == 2:  # a row with random values
        row = {"question": random_json(rng), "answer": random_json(rng)}
        return json.dumps(row, allow_nan=True).encode()
    if kind == 3:  # truncated JSON
        text = json.dumps({"question": "x" * rng.randrange(50), "answer": "1"})
        return text[:rng.randrange(len(text))].encode()
    return json.dumps(random_json(rng), allow_nan=True).encode()


@pytest.mark.parametrize("case", range(40))
def test_data_loader_fuzz(tmp_path, tokenizer, case):
    rng = random.Random(SEED + case)
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(random_line(rng) for _ in range(rng.randrange(1, 30))))
    for on_bad_row in ("error", "skip"):
        cfg = DataConfig(path=str(path), on_bad_row=on_bad_row, max_prompt_tokens=256)
        try:
            prompts, report = load_prompts(cfg, tokenizer)
        except ValueError as e:
            msg = str(e)
            assert str(path) in msg, msg  # the file is named
            if on_bad_row == "error" and "row " in msg:
                assert "(line " in msg, msg  # and the line of the bad row
            continue
        assert report.num_kept == len(prompts) >= 1
        assert report.num_kept + report.num_skipped == report.num_rows
        assert all(p.answer and p.token_ids for p in prompts)
        if on_bad_row == "error":
            assert report.num_skipped == 0


def random_completion(rng: random.Random) -> str:
    size = rng.choice([0, 10, 1000, 100_000])
    if rng.random() < 0.3:  # one piece repeated: degenerate responses
        return rng.choice(_PIECES) * (size // 2 + 1)
    return "".join(rng.choice(_PIECES) for _ in range(size // 4 + 1))


def test_reward_path_fuzz():
    rng = random.Random(SEED)
    completions = [random_completion(rng) for _ in range(60)]
    completions += ["\\boxed{4}" + "\\boxed{" * 50_000, "junk " * 20_000 + "\\boxed{4}"]
    t0 = time.perf_counter()
    for c in completions:
        extract_answer(c)
    assert time.perf_counter() - t0 < 5.0  # linear: 62 completions of up to ~400 kB
    cfg = RewardConfig(name="math", timeout_s=5.0, num_workers=2)
    with RewardScorer(cfg) as scorer:
        t0 = time.perf_counter()
        out = scorer.score(completions, ["4"] * len(completions))
        elapsed = time.perf_counter() - t0
    assert set(out.rewards) <= {0.0, 1.0}
    assert out.rewards[-2:] == [1.0, 1.0]  # a correct last complete box scores, junk or not
    assert out.num_errors == 0, out.errors
    # within the limit: at worst every case is killed at timeout_s, two at a time
    assert elapsed < out.num_timeouts * cfg.timeout_s / 2 + 60, (elapsed, out.num_timeouts)

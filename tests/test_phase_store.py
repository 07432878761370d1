"""A phase on disk: shards written in any order by any replica, indexed once with vectorised
advantages, read back row by row; pending groups and replica shares for a resume with another
number of replicas; the leader's writer with a real reward pool; the engines' default stream."""

import math
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import Sample, to_batch

from mugrpo_megatron.config import RewardConfig
from mugrpo_megatron.engines.base import Generation, RolloutEngine, SamplingSpec
from mugrpo_megatron.engines.fleet import share
from mugrpo_megatron.phase.data import PhaseData
from mugrpo_megatron.phase.generation import ReplicaCounts, ShardWriter
from mugrpo_megatron.phase.store import (
    Advantages,
    ScoredGroup,
    finalize,
    is_generated,
    persisted_groups,
    write_shard,
)
from mugrpo_megatron.rewards import RewardScorer
from mugrpo_megatron.types import Prompt

G = 4


def make_groups(n_groups=30, seed=0):
    rng = random.Random(seed)
    out = []
    for pos in range(n_groups):
        uniform = pos % 5 == 0
        gens, rewards = [], []
        for _ in range(G):
            n = rng.randint(0, 9)
            gens.append(Generation(tuple(rng.randint(3, 90) for _ in range(n)),
                                   tuple(-rng.random() for _ in range(n)),
                                   rng.choice(["stop", "length"])))
            rewards.append(1.0 if uniform else float(rng.random() < 0.5))
        out.append(ScoredGroup.of(pos, 1000 + pos, tuple(range(1, 2 + pos % 4)), gens, rewards))
    return out


def generations(g: ScoredGroup) -> list[Generation]:
    """A persisted group's responses back as the engine's tuples."""
    return [Generation(tuple(r.tolist()), tuple(lp.tolist()), f)
            for r, lp, f in zip(g.responses, g.logprobs, g.finish_reasons)]


def naive_advantages(rewards, eps=1e-6):
    out = []
    for k in range(0, len(rewards), G):
        r = rewards[k:k + G]
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        out += [0.0 if max(r) == min(r) else (x - mean) / (std + eps) for x in r]
    return out


def write_scrambled(directory: Path, groups, seed=1):
    order = list(groups)
    random.Random(seed).shuffle(order)
    for k in range(0, len(order), 7):  # shards of 7 groups in completion order, not phase order
        write_shard(directory, order[k:k + 7])


def test_index_and_rows_equal_a_naive_reference(tmp_path):
    groups = make_groups()
    write_scrambled(tmp_path, groups)
    assert not is_generated(tmp_path) and persisted_groups(tmp_path, 30).all()
    finalize(tmp_path, 30, G, Advantages())
    data = PhaseData(tmp_path, drop_uniform=True)
    samples = [Sample(0, g.prompt_index, g.position, tuple(g.prompt_ids), x.token_ids, x.logprobs,
                      x.finish_reason, reward=r) for g in groups
               for x, r in zip(generations(g), g.rewards)]
    rewards = [s.reward for s in samples]
    assert data.reward.tolist() == rewards
    assert data.advantage.tolist() == pytest.approx(naive_advantages(rewards), abs=1e-12)
    uniform = {g.position for g in groups if len(set(g.rewards)) == 1}
    assert data.num_uniform_groups == len(uniform)
    assert data.train_rows.tolist() == [i for i, s in enumerate(samples) if s.group not in uniform]
    stats = data.stats()
    assert stats["response_tokens"] == sum(len(s.response_ids) for s in samples)
    assert stats["truncated_frac"] == sum(s.finish_reason == "length" for s in samples) / 120
    rows = np.array([5, 0, 119, 33, 64, 64])
    got = data.batch(rows, multiple_of=4)
    from dataclasses import replace
    want = to_batch([replace(samples[i], advantage=float(data.advantage[i])) for i in rows],
                    pad_id=0, multiple_of=4)
    for name in ("tokens", "response_mask", "behav_logp", "advantages"):
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert PhaseData(tmp_path, drop_uniform=False).train_rows.tolist() == list(range(120))
    assert not list(tmp_path.glob(".*.tmp"))


def test_finalize_names_missing_and_doubled_groups(tmp_path):
    groups = make_groups(10)
    write_shard(tmp_path, groups[:4])
    write_shard(tmp_path, groups[5:])
    with pytest.raises(ValueError, match=r"4 of 40 responses are missing \(first: group 4\)"):
        finalize(tmp_path, 10, G, Advantages())
    write_shard(tmp_path / "x", groups[3:5])
    (tmp_path / "x" / "shard_000000003.arrow").rename(tmp_path / "shard_000000004.arrow")
    with pytest.raises(ValueError, match="shard_000000004.arrow: holds responses .* another shard"):
        finalize(tmp_path, 10, G, Advantages())
    with pytest.raises(FileExistsError, match="group 0 was persisted already"):
        write_shard(tmp_path, groups[:1])


def test_resume_with_another_replica_count_regenerates_only_what_is_missing(tmp_path):
    groups = make_groups(23)
    pending = np.arange(23)
    two = [pending[share(len(pending), r, 2)] for r in range(2)]
    assert np.concatenate(two).tolist() == list(range(23))  # every group once, in order
    # replica 0 persisted part of its share, replica 1 all but its last groups, then a kill
    write_shard(tmp_path, [groups[i] for i in two[0][:5]])
    write_shard(tmp_path, [groups[i] for i in two[1][:-3]])
    left = np.flatnonzero(~persisted_groups(tmp_path, 23))
    assert left.tolist() == two[0][5:].tolist() + two[1][-3:].tolist()
    one = left[share(len(left), 0, 1)]  # resumed with one replica
    assert one.tolist() == left.tolist()
    write_shard(tmp_path, [groups[i] for i in one])
    finalize(tmp_path, 23, G, Advantages())
    assert PhaseData(tmp_path, drop_uniform=False).reward.tolist() == \
        [r for g in groups for r in g.rewards]


def test_writer_scores_beside_generation(tmp_path):
    from mugrpo_megatron.models.tiny import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    answers = ["7", "12", "3"]
    prompts = [Prompt(i, f"q{i}", a, (5, 6)) for i, a in enumerate(answers)]
    texts = {0: "so \\boxed{7}", 1: "maybe \\boxed{13}", 2: "\\boxed{3}"}
    counts = ReplicaCounts()
    cfg = RewardConfig(name="math", num_workers=2)
    with RewardScorer(cfg) as scorer:
        writer = ShardWriter(tmp_path / "p", scorer, tok, prompts, (2, 0, 1).__getitem__, 2,
                             counts)
        for pos in (1, 0, 2):  # completion order
            ids = tuple(tok(texts[(2, 0, 1)[pos]])["input_ids"])
            writer.add(pos, [Generation(ids, (-0.1,) * len(ids), "stop")] * G)
        writer.close()
    assert counts.groups == 3 and counts.shards == 2 and counts.responses == 3 * G
    finalize(tmp_path / "p", 3, G, Advantages())
    data = PhaseData(tmp_path / "p", drop_uniform=False)
    expected = {0: 1.0, 1: 0.0, 2: 1.0}  # prompt row -> reward of its text against its answer
    assert data.reward.tolist() == [expected[(2, 0, 1)[pos]] for pos in range(3) for _ in range(G)]


class Counting(RolloutEngine):
    """Deterministic by seed: each response is its seed's digits (the base class's stream)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        return [[Generation((sampling.seed + i * sampling.n + j,), (0.0,), "stop")
                 for j in range(sampling.n)] for i in range(len(prompts))]

    update_weights = shutdown = None


def test_default_stream_seeds_by_position():
    e = Counting()
    positions = [3, 4, 5, 9, 10, 20]
    spec = SamplingSpec(n=2, max_new_tokens=1, seed=100)
    got = dict(e.generate_stream([(1,)] * 6, spec, positions, max_in_flight=4))
    assert sorted(got) == list(range(6))
    assert all(got[i][j].token_ids == (100 + positions[i] * 2 + j,) for i in range(6) for j in range(2))
    assert e.calls == [3, 1, 1, 1]  # windows of 4, one call per run of consecutive positions

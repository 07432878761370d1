"""The phase scheduler: GRPO and Mu-GRPO as two settings, epochs and reshuffling."""

from collections import Counter

import pytest

from mugrpo_megatron.config import AlgoConfig, Config, RolloutConfig
from mugrpo_megatron.phase.schedule import PhaseScheduler


def make(mu, group_size=8, num_prompts=1000, **kw):
    args = dict(total_updates=4096, updates_per_phase=mu, prompts_per_phase=64,
                samples_per_update=128, seed=7)
    args.update(kw)
    cfg = Config(algo=AlgoConfig(**args), rollout=RolloutConfig(group_size=group_size))
    return PhaseScheduler(cfg.algo, group_size, num_prompts)


def test_grpo_and_mu_grpo_are_two_settings():
    grpo, mu = make(4, prompts_per_phase=64), make(1024, prompts_per_phase=4096, num_prompts=20000)
    assert grpo.num_phases == 1024 and mu.num_phases == 4
    phases = list(mu.phases())
    assert [p.first_update for p in phases] == [0, 1024, 2048, 3072]
    assert all(p.num_updates == 1024 for p in phases)
    # GRPO mu=4 with 64 prompts x 8 = 512 samples and 128 per update: exactly one epoch per phase
    mbs = list(grpo.minibatches(grpo.phase(0), 512))
    assert [m.epoch for m in mbs] == [0, 0, 0, 0]
    assert sorted(i for m in mbs for i in m.sample_indices) == list(range(512))


def test_many_updates_cycle_reshuffled_epochs():
    s = make(40, prompts_per_phase=16, group_size=4, samples_per_update=10, total_updates=400)
    phase = s.phase(1)
    mbs = list(s.minibatches(phase, 64))  # 6 minibatches per epoch, tail of 4 left over
    assert len(mbs) == 40
    assert [m.update for m in mbs] == list(range(40, 80))
    assert [m.step_in_phase for m in mbs] == list(range(40))
    assert all(len(m.sample_indices) == 10 for m in mbs)
    by_epoch = {}
    for m in mbs:
        by_epoch.setdefault(m.epoch, []).extend(m.sample_indices)
    assert len(by_epoch) == 7
    for epoch, idx in by_epoch.items():
        assert len(idx) == len(set(idx)), f"epoch {epoch} repeats a sample"
    assert by_epoch[0] != by_epoch[1]  # reshuffled
    # over many epochs every sample is used about equally often
    counts = Counter(i for m in mbs for i in m.sample_indices)
    assert set(counts) == set(range(64))
    assert s.passes(64) == pytest.approx(40 * 10 / 64) == sum(counts.values()) / 64


@pytest.mark.parametrize("num_samples", [640, 613, 300, 41])
def test_uniform_groups_dropped_once_use_each_sample_once(num_samples):
    """uniform_groups: drop_once. What is left after dropping uniform groups (num_samples of a
    phase made for mu x samples_per_update = 640) is cut into mu updates of num_samples / mu (a
    multiple of the learner's quantum): each sample is used once at most, and passes() says how
    many passes the updates made."""
    s = make(16, prompts_per_phase=160, group_size=4, samples_per_update=40, total_updates=64)
    size = s.update_size(num_samples, once=True, quantum=2)
    mbs = list(s.minibatches(s.phase(0), num_samples, size))
    used = [i for m in mbs for i in m.sample_indices]
    assert len(mbs) == 16 and all(len(m.sample_indices) == size for m in mbs)
    assert size % 2 == 0 and size <= 40
    if num_samples >= 32:  # at least one quantum an update without reuse
        assert len(used) == len(set(used)) and len(used) > num_samples - 16 * 2
    assert s.passes(num_samples, size) == pytest.approx(len(used) / num_samples)
    # 'drop' instead: mu updates of samples_per_update from what is left, reused
    assert s.update_size(num_samples, once=False, quantum=2) == min(40, num_samples) // 2 * 2


def test_deterministic_and_seed_dependent():
    a = [m.sample_indices for m in make(8).minibatches(make(8).phase(2), 300)]
    b = [m.sample_indices for m in make(8).minibatches(make(8).phase(2), 300)]
    c = [m.sample_indices for m in make(8, seed=8).minibatches(make(8, seed=8).phase(2), 300)]
    assert a == b and a != c


def test_prompts_cover_dataset_before_repeating():
    s = make(4, prompts_per_phase=30, num_prompts=100, total_updates=40)
    seen = [i for p in list(s.phases())[:3] for i in p.prompt_indices] + list(s.phase(3).prompt_indices[:10])
    assert sorted(seen) == list(range(100))
    assert len(s.phase(4).prompt_indices) == 30


def test_few_samples_after_filtering_use_all():
    s = make(4)
    mbs = list(s.minibatches(s.phase(0), 50))
    assert all(sorted(m.sample_indices) == list(range(50)) for m in mbs)
    with pytest.raises(ValueError, match="no samples"):
        next(s.minibatches(s.phase(0), 0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple"):
        make(1000)
    with pytest.raises(ValueError, match="samples_per_update"):
        make(4, samples_per_update=10_000)
    with pytest.raises(ValueError, match="empty"):
        make(4, num_prompts=0)

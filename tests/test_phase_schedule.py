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
    assert all(p.max_updates == p.planned_updates == 1024 for p in phases)
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


def drifting_run(s, drift_of_step, updates_of_phase=None):
    """Plan and run phases as the trainer does, with a drift at each step given by
    ``drift_of_step(phase, step)``; the ended phases and the phases planned."""
    from mugrpo_megatron.phase.schedule import DriftBound, PhaseEnd

    ended, planned = [], []
    while (phase := s.plan(ended)) is not None:
        planned.append(phase)
        bound, done, stop = DriftBound(s.algo), 0, False
        for mb in s.minibatches(phase, 4096):
            done = mb.step_in_phase + 1
            if bound.observe(mb.step_in_phase, drift_of_step(phase.index, mb.step_in_phase)):
                stop = True
                break
        end = "drift" if stop and done < phase.max_updates else "mu"
        ended.append(PhaseEnd(phase.index, phase.first_update, done, end, phase.num_prompts))
    return ended, planned


def test_drift_bound_ends_phases_and_the_updates_add_up():
    """algo.max_drift: a phase ends once the mean of the last drift_window updates' |log rho|
    reaches the bound, after min_phase_updates; the next starts where it ended and generates for
    the updates the recent phases ran (prompts_per_phase / mu an update); the run makes exactly
    total_updates updates, in as many phases as it takes."""
    s = make(64, prompts_per_phase=256, samples_per_update=32, total_updates=256,
             max_drift=0.049, drift_window=4, min_phase_updates=8)
    # drift grows linearly within a phase, 0.004 an update: the window's mean first reaches
    # 0.049 when the window ends at step 14 (0.044 .. 0.056, mean 0.05; at step 13, 0.046)
    ended, planned = drifting_run(s, lambda phase, step: 0.004 * step)
    assert sum(e.updates for e in ended) == 256
    assert [e.updates for e in ended[:-1]] == [15] * (len(ended) - 1)
    assert all(e.end == "drift" for e in ended[:-1]) and ended[-1].updates <= 15
    assert [p.first_update for p in planned] == [15 * i for i in range(len(planned))]
    # the first phase generates for mu updates, the next for the 15 a phase ran
    assert planned[0].planned_updates == 64 and planned[0].num_prompts == 256
    assert all(p.planned_updates == 15 and p.num_prompts == 60 for p in planned[1:-1])
    assert planned[-1].max_updates == 256 - 15 * (len(planned) - 1)
    starts = [p.prompt_start for p in planned]
    assert starts == [sum(p.num_prompts for p in planned[:i]) for i in range(len(planned))]
    # min_phase_updates holds however early the bound is crossed
    ended, _ = drifting_run(s, lambda phase, step: 1.0)
    assert [e.updates for e in ended] == [8] * 32 and ended[0].end == "drift"


def test_a_bound_never_reached_changes_nothing():
    """GRPO mu=4 (and Mu-GRPO) with the bound set behave as without it while the drift stays
    under it: the same phases, prompts and minibatches; a bound crossed at a phase's last
    update ends it as mu would ('mu')."""
    plain = make(4, prompts_per_phase=16, samples_per_update=32, total_updates=64)
    bounded = make(4, prompts_per_phase=16, samples_per_update=32, total_updates=64,
                   max_drift=0.5, min_phase_updates=4)
    ended, planned = drifting_run(bounded, lambda phase, step: 0.1)
    assert planned == list(plain.phases()) and all(e.end == "mu" for e in ended)
    ended, planned = drifting_run(bounded, lambda phase, step: 1.0)  # crossed at step 3 of 4
    assert planned == list(plain.phases()) and all(e.end == "mu" for e in ended)
    assert [m.sample_indices for m in bounded.minibatches(planned[3], 128)] == \
        [m.sample_indices for m in plain.minibatches(plain.phase(3), 128)]


def test_schedule_state_round_trips_and_reads_old_checkpoints():
    """What a checkpoint keeps of the schedule comes back as it was (JSON), and a checkpoint
    saved before drift-bounded schedules (counters without 'schedule') reads as the fixed
    schedule's phases up to its update."""
    import json

    from mugrpo_megatron.phase.schedule import PhaseEnd, ScheduleState

    s = make(64, prompts_per_phase=256, samples_per_update=32, total_updates=256, max_drift=0.05)
    state = ScheduleState([PhaseEnd(0, 0, 15, "drift", 256)], [0.01, 0.02])
    back = ScheduleState.from_counters(json.loads(json.dumps({"update": 20, "schedule":
                                                              state.to_json()})), s.algo)
    assert back == state
    old = ScheduleState.from_counters({"update": 130, "phase": 2}, s.algo)
    assert old.ended == [PhaseEnd(0, 0, 64, "mu", 256), PhaseEnd(1, 64, 64, "mu", 256)]
    assert s.plan(old.ended) == s.phase(2)


def test_drift_settings_are_checked():
    with pytest.raises(ValueError, match=r"algo\.max_drift: must be > 0"):
        make(64, prompts_per_phase=256, max_drift=0.0)
    with pytest.raises(ValueError, match=r"algo\.min_phase_updates: must be at most"):
        make(4, max_drift=0.1, min_phase_updates=8)
    with pytest.raises(ValueError, match=r"algo\.drift_window: must be > 0"):
        make(4, drift_window=0)

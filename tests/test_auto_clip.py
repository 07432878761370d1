"""``algo.clip_high: auto`` (the paper's open question 2): the effective sample size of the
positive-advantage tokens' capped ratios, summed in the loss and combined over any split as one
batch's, against a naive loop; the rule that picks the next update's clip from it; and the clip
the loss then applies."""

import pytest
import torch
from test_objective import random_batch

from mugrpo_megatron.config import AlgoConfig
from mugrpo_megatron.loss_metrics import combine_metrics, ess_fractions
from mugrpo_megatron.objective import policy_loss
from mugrpo_megatron.phase import AutoClip, ScheduleState

GRID = (0.2, 0.5, 1.0, 2.0, 3.0, 4.0)


def naive_ess(logp, behav, adv, resp, eps) -> float:
    """(sum w)^2 / (n sum w^2) over the kept A > 0 tokens, w = min(rho, 1 + eps), one at a time
    (A > 0 tokens are never vetoed, so 'kept' is every response token of them)."""
    ws = []
    for b in range(len(logp)):
        if not adv[b] > 0:
            continue
        for t in range(len(logp[b])):
            if resp[b][t]:
                ws.append(min(float(torch.exp(logp[b][t] - behav[b][t])), 1.0 + eps))
    return sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_ess_at_each_candidate_is_one_batch_s_whatever_the_split(seed):
    logp, behav, adv, resp = random_batch(seed, B=12, spread=1.0)
    kw = dict(clip_low=1.0, clip_high=4.0, veto_threshold=1e-4, ess_grid=GRID,
              num_tokens=int(resp.sum()), num_sequences=int(resp.any(1).sum()))
    parts = []
    for idx in (slice(0, 1), slice(1, 7), slice(7, 12)):
        _, m = policy_loss(logp[idx], behav[idx], adv[idx], resp[idx], **kw)
        parts.append(m)
    got = ess_fractions(combine_metrics(parts), GRID)
    want = [naive_ess(logp, behav, adv, resp, eps) for eps in GRID]
    assert got == pytest.approx(want, rel=1e-5)
    assert want[0] > want[-1]  # a wide clip keeps the heavy ratios: a smaller ESS
    _, plain = policy_loss(logp, behav, adv, resp, clip_low=1.0, clip_high=4.0)
    assert not any(k.startswith("ess_") for k in combine_metrics([plain]))  # off without auto


def test_the_rule_takes_the_widest_clip_that_keeps_half_the_sample():
    algo = AlgoConfig(clip_high="auto", clip_high_auto_grid=GRID, clip_high_auto_ess=0.5)
    clip = AutoClip(algo)
    assert clip.clip == 4.0  # a phase's first update: every ratio is 1

    def metrics(ess):  # E w = 1, E w^2 = 1 / ess
        out = {"num_ess_tokens": 10.0}
        for i, e in enumerate(ess):
            out[f"ess_capped_mean_{i}"], out[f"ess_capped_sq_mean_{i}"] = 1.0, 1.0 / e
        return out

    m = metrics([0.99, 0.9, 0.7, 0.55, 0.45, 0.3])
    clip.observe(m)
    assert clip.clip == 2.0  # the widest at ESS >= 0.5
    assert m["clip_high"] == 4.0 and m["ess_clip_2"] == pytest.approx(0.55)  # logged: the one used
    assert not any(k.startswith("ess_capped") for k in m)
    clip.observe(metrics([0.4] * 6))
    assert clip.clip == 0.2  # none keeps it: the narrowest
    clip.observe({"num_ess_tokens": 0.0})  # no A > 0 token: as it was
    assert clip.clip == 0.2
    # a checkpoint keeps it, and a resume goes on with it
    state = ScheduleState([], [], clip.clip)
    again = ScheduleState.from_counters({"schedule": state.to_json(), "update": 3}, algo)
    assert AutoClip(algo, again.clip_high).clip == 0.2


def test_the_loss_clips_at_the_clip_it_is_given():
    """A positive-advantage token whose ratio is above the given clip has no gradient; below it,
    it has one."""
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    behav = torch.log(torch.tensor([[1 / 2.5, 1 / 1.5]], dtype=torch.float64))  # rho 2.5, 1.5
    adv, resp = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, behav, adv, resp, clip_low=1.0, clip_high=1.0, ess_grid=GRID)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    assert float(m["clip_frac_high"]) == 0.5

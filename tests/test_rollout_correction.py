"""Rollout correction (``algo.rollout_is`` / ``rollout_rs``): truncated and masked importance
sampling between the engine's sampling and the learner's behaviour log-probs, against their
formulas written out token by token; through a phase's batches (with tool messages' holes);
in the loss; refused where there is nothing to correct. Every layout of the learner carries
each token's weight to its loss: ``tests/test_learner.py`` (its batch has weights), against
transformers with ``policy_loss`` here."""

import math

import numpy as np
import pytest
import torch
from test_phase_store import G, make_groups, write_scrambled

from mugrpo_megatron.config import AlgoConfig
from mugrpo_megatron.objective import policy_loss
from mugrpo_megatron.phase.data import LearnerLogprobWriter, PhaseData
from mugrpo_megatron.phase.store import Advantages, finalize
from mugrpo_megatron.rollout_correction import (
    Correction,
    CorrectionStats,
    correct,
)

LEVELS = [(None, "token"), (None, "sequence"), (None, "geometric"), ("token", None),
          ("sequence", None), ("token", "geometric"), ("sequence", "token")]


def naive(old, rollout, mask, c: Correction):
    """The formulas, one token at a time in plain Python."""
    weights, keeps = [], []
    for o_row, r_row, m_row in zip(old.tolist(), rollout.tolist(), mask.tolist()):
        logs = [min(max(o - r, -20.0), 20.0) for o, r, m in zip(o_row, r_row, m_row) if m]
        total = min(max(sum(logs), -20.0), 20.0)
        w_row, k_row, t = [], [], 0
        reject = False
        if c.rs_level == "sequence":
            reject = not c.rs_lower <= math.exp(total) <= c.rs_upper
        if c.rs_level == "geometric" and logs:
            reject = not c.rs_lower <= math.exp(sum(logs) / len(logs)) <= c.rs_upper
        for m in m_row:
            if not m:
                w_row.append(1.0)
                k_row.append(False)
                continue
            lw = logs[t]
            t += 1
            if c.is_level == "token":
                w_row.append(min(math.exp(lw), c.is_threshold))
            elif c.is_level == "sequence":
                w_row.append(min(math.exp(total), c.is_threshold))
            else:
                w_row.append(1.0)
            out = reject or (c.rs_level == "token" and not c.rs_lower <= math.exp(lw) <= c.rs_upper)
            k_row.append(not out)
        weights.append(w_row)
        keeps.append(k_row)
    return weights, keeps


def rows(seed=0, b=6, s=12):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, s, generator=g) * 3
    old = rollout + torch.randn(b, s, generator=g) * 0.4
    old[0, 3] = rollout[0, 3] + 30.0  # past the +-20 bound
    mask = torch.rand(b, s, generator=g) < 0.7
    mask[1] = False  # no model token at all
    mask[2, 4:7] = False  # a tool message's hole
    return old, rollout, mask


@pytest.mark.parametrize("is_level, rs_level", LEVELS)
def test_weights_and_rejections_are_the_formulas(is_level, rs_level):
    old, rollout, mask = rows()
    upper = {"geometric": 1.05, "sequence": 4.0}.get(rs_level, 1.5)
    c = Correction(is_level, 1.7, rs_level, upper, 1 / upper)
    weight, keep = correct(old, rollout, mask, c)
    want_w, want_k = naive(old, rollout, mask, c)
    if is_level is None:
        assert weight is None
    else:
        assert weight.dtype == torch.float32
        assert torch.allclose(weight.double(), torch.tensor(want_w, dtype=torch.float64),
                              rtol=1e-6)
        assert weight.max() <= 1.7 and (weight[~mask] == 1).all()
    assert keep.tolist() == want_k
    if rs_level is not None:  # the rows chosen make the rejection act, and not on everything
        assert 0 < int((mask & ~keep).sum()) < int(mask.sum()), (rs_level, keep)


def test_the_loss_weights_each_kept_tokens_surrogate():
    """policy_loss with is_weight: sum over kept tokens of -w * min(rho A, clip(rho) A) / N, and
    its gradient; weights of 1 are the unweighted loss."""
    g = torch.Generator().manual_seed(1)
    b, s = 4, 10
    behav = -torch.rand(b, s, generator=g) * 2
    mask = torch.rand(b, s, generator=g) < 0.8
    adv = torch.randn(b, generator=g)
    weight = torch.where(mask, 0.3 + torch.rand(b, s, generator=g) * 1.5, torch.ones(b, s))
    logp = (behav + torch.randn(b, s, generator=g) * 0.3).requires_grad_()
    loss, _ = policy_loss(logp, behav, adv, mask, clip_low=0.2, clip_high=0.28, is_weight=weight)
    loss.backward()
    ref_logp = logp.detach().clone().requires_grad_()
    total = 0.0
    for i in range(b):
        for t in range(s):
            if mask[i, t]:
                rho = torch.exp(ref_logp[i, t] - behav[i, t])
                surr = torch.minimum(rho * adv[i], rho.clamp(0.8, 1.28) * adv[i])
                total = total - weight[i, t] * surr
    want = total / mask.sum()
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-7)
    plain, _ = policy_loss(logp.detach(), behav, adv, mask, clip_low=0.2, clip_high=0.28)
    ones, _ = policy_loss(logp.detach(), behav, adv, mask, clip_low=0.2, clip_high=0.28,
                          is_weight=torch.ones(b, s))
    assert float(ones) == float(plain)


def test_a_phases_batches_carry_the_correction_of_whole_rows(tmp_path):
    """PhaseData with the learner's behaviour log-probs and a correction: each batch's ratios
    divide by the learner's log-probs, its weights and kept tokens are the formulas' between
    the learner's and the engine's log-probs of the same rows, wherever the rows come from;
    without a correction, no weights and the mask as generated. And the behaviour pass's
    numbers (``CorrectionStats``) over the same rows."""
    groups = make_groups()
    write_scrambled(tmp_path, groups)
    finalize(tmp_path, len(groups), G, Advantages())
    data = PhaseData(tmp_path, drop_uniform=False)
    rng = np.random.default_rng(0)
    engine = [data.response(i)[2] for i in range(data.num_samples)]
    learner = [(lp + rng.normal(0, 1.0, len(lp))).astype(np.float32) for lp in engine]
    writer = LearnerLogprobWriter(tmp_path, data.num_samples)
    writer.add(learner)
    writer.commit()
    c = Correction("token", 2.0, "sequence", 1.5, 1 / 1.5)
    data.use_learner_logprobs(c)
    picked = np.array([7, 0, 119, 64, 33, 64, 5, 18, 41, 90])
    got = data.batch(picked, multiple_of=4)
    plain = PhaseData(tmp_path, drop_uniform=False)
    plain.use_learner_logprobs()
    base = plain.batch(picked, multiple_of=4)
    assert base.is_weight is None
    assert torch.equal(got.behav_logp, base.behav_logp)
    engine_bt = torch.zeros_like(base.behav_logp)
    for k, i in enumerate(picked):
        prompt, response, lp = data.response(int(i))
        engine_bt[k, len(prompt):len(prompt) + len(response)] = torch.tensor(lp)
        assert base.behav_logp[k, len(prompt):len(prompt) + len(response)].tolist() == \
            pytest.approx(learner[i].tolist())
    want_w, want_k = naive(base.behav_logp, engine_bt, base.response_mask, c)
    assert torch.allclose(got.is_weight.double(), torch.tensor(want_w, dtype=torch.float64),
                          rtol=1e-6)
    assert got.response_mask.tolist() == want_k
    rejected = base.response_mask.any(1) & ~got.response_mask.any(1)
    assert 0 < int(rejected.sum()) < int(base.response_mask.any(1).sum())  # some, whole
    stats = CorrectionStats()
    weight, keep = correct(base.behav_logp, engine_bt, base.response_mask, c)
    stats.add(base.response_mask, weight, keep, c)
    rec = stats.record()
    n = int(base.response_mask.sum())
    flat_w = [w for row, m in zip(want_w, base.response_mask.tolist())
              for w, x in zip(row, m) if x]
    assert rec["rollout_is_weight_mean"] == pytest.approx(sum(flat_w) / n)
    assert rec["rollout_is_truncated_frac"] == sum(w >= 2.0 for w in flat_w) / n
    assert rec["rollout_rs_token_frac"] == int((base.response_mask & ~keep).sum()) / n


@pytest.mark.parametrize("key, value, message", [
    ("rollout_is", "token", "needs algo.behaviour_logprobs: learner"),
    ("rollout_rs", "geometric", "needs algo.behaviour_logprobs: learner"),
])
def test_refused_where_the_ratio_divides_by_the_engines_log_probs(key, value, message):
    with pytest.raises(ValueError, match=f"algo.{key}.*{message}"):
        AlgoConfig(**{key: value})
    AlgoConfig(**{key: value}, behaviour_logprobs="learner")


def test_the_bounds_are_checked():
    with pytest.raises(ValueError, match=r"algo.rollout_rs.*must be one of \['token', "
                                         r"'sequence', 'geometric'\] or null"):
        AlgoConfig(behaviour_logprobs="learner", rollout_rs="seq")
    with pytest.raises(ValueError, match="algo.rollout_rs_threshold_lower"):
        AlgoConfig(behaviour_logprobs="learner", rollout_rs="token", rollout_rs_threshold=2.0,
                   rollout_rs_threshold_lower=2.5)
    with pytest.raises(ValueError, match="algo.rollout_is_threshold"):
        AlgoConfig(behaviour_logprobs="learner", rollout_is="token", rollout_is_threshold=0)
    a = AlgoConfig(behaviour_logprobs="learner", rollout_rs="geometric",
                   rollout_rs_threshold=1.001)
    assert Correction.of(a) == Correction(None, 2.0, "geometric", 1.001, 1 / 1.001)
    assert Correction.of(AlgoConfig()) is None

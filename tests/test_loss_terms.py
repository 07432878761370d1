"""The GRPO family's terms around the Mu-GRPO objective against naive per-token and per-sequence
Python loops: loss aggregation (verl's four ``loss_agg_mode``s), the KL estimators k1/k2/k3 with
verl's clamps, the entropy bonus and its gradient, Dr.GRPO's advantages and DAPO's overlong
penalty; and each mode's invariance to how the minibatch is split (microbatches, DP ranks).

The references are written from the formulas (verl ``core_algos.agg_loss`` and
``kl_penalty_forward`` at commit b178a3cd5; DAPO eq. 13; Dr.GRPO), one token at a time."""

import math

import pytest
import torch
from test_objective import naive_keep, random_batch

from mugrpo_megatron.loss_metrics import combine_metrics
from mugrpo_megatron.objective import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    group_advantages,
    kl_estimate,
    overlong_penalty,
    policy_loss,
)

CLIP = dict(clip_low=1.0, clip_high=4.0)
NORM = 16.0  # seq-mean-token-sum-norm's constant in these tests


def naive_kl(logp: float, ref: float, estimator: str) -> float:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    x = min(max(ref - logp, -20.0), 20.0)  # log(pi_ref / pi), clamped as verl does
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def naive_terms(logp, behav, adv, resp, ref, entropy, *, agg, kl_coef=0.0, estimator="k3",
                entropy_coef=0.0, threshold=1e-4, scope="suffix", clip_low=1.0, clip_high=4.0):
    """The loss one response at a time: each response's kept tokens' terms, weighted by its
    aggregation weight, over the minibatch's denominator."""
    B, T = len(logp), len(logp[0])
    lr = [[(logp[b][t] - behav[b][t]) if resp[b][t] else 0.0 for t in range(T)] for b in range(B)]
    keep = naive_keep(lr, adv, resp, threshold, scope)
    n_tok = sum(resp[b][t] for b in range(B) for t in range(T))
    n_seq = sum(any(resp[b]) for b in range(B))
    denom = {"token-mean": n_tok, "seq-mean-token-mean": n_seq, "seq-mean-token-sum": n_seq,
             "seq-mean-token-sum-norm": n_seq * NORM}[agg]
    total = pg = kl_total = 0.0
    for b in range(B):
        length = sum(resp[b])
        w = 1.0 / length if agg == "seq-mean-token-mean" and length else 1.0
        for t in range(T):
            if not keep[b][t]:
                continue
            rho = math.exp(lr[b][t])
            surr = min(rho * adv[b], min(max(rho, 1 - clip_low), 1 + clip_high) * adv[b])
            kl = naive_kl(logp[b][t], ref[b][t], estimator) if kl_coef else 0.0
            pg += -w * surr / denom
            kl_total += w * kl_coef * kl / denom
            total += w * (-surr + kl_coef * kl - entropy_coef * entropy[b][t]) / denom
    return total, pg, kl_total


def batch_with_ref(seed: int, B: int = 10, T: int = 15):
    logp, behav, adv, resp = random_batch(seed, B=B, T=T)
    g = torch.Generator().manual_seed(seed + 100)
    ref = behav + torch.randn(B, T, generator=g, dtype=torch.float64) * 2.0
    ref[0, :] -= 30.0  # beyond k3's clamps: log(pi_ref / pi) < -20 on some tokens
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return logp, behav, adv, resp, ref, entropy


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_terms_match_naive(agg, estimator, seed):
    logp, behav, adv, resp, ref, entropy = batch_with_ref(seed)
    entropy = entropy.requires_grad_()
    loss, m = policy_loss(logp, behav, adv, resp, **CLIP, veto_threshold=1e-4, loss_agg=agg,
                          loss_agg_norm=NORM, kl_coef=0.3, kl_estimator=estimator, ref_logp=ref,
                          entropy=entropy, entropy_coef=0.05)
    want, pg, kl = naive_terms(logp.tolist(), behav.tolist(), adv.tolist(), resp.tolist(),
                               ref.tolist(), entropy.tolist(), agg=agg, kl_coef=0.3,
                               estimator=estimator, entropy_coef=0.05)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert float(m["pg_loss"]) == pytest.approx(pg, rel=1e-6, abs=1e-9)
    assert float(m["kl_loss"]) == pytest.approx(kl, rel=1e-6, abs=1e-9)
    assert m["entropy_loss"] < 0  # a bonus: it lowers the loss


def test_kl_estimators_and_clamps_by_hand():
    logp = torch.tensor([-1.0, -2.0, -1.0, -50.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -1.0, -1.0], dtype=torch.float64)
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0, 0.0, -49.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5, 0.0, 1200.5])
    k3 = kl_estimate(logp, ref, "k3").tolist()
    assert k3[:3] == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.exp(1) - 2, 0.0])
    assert k3[3] == 10.0  # log(pi_ref / pi) = 49, clamped to 20, and the estimate to 10
    for est in KL_ESTIMATORS:
        assert naive_kl(-1.0, -1.5, est) == pytest.approx(kl_estimate(logp[:1], ref[:1], est)[0])
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_every_aggregation_is_the_one_big_batch_value_whatever_the_split(agg):
    """Microbatches (and DP ranks) given the whole minibatch's counts sum to the whole batch's
    loss and gradient, for every mode: each is a fixed weighted sum over tokens."""
    logp, behav, adv, resp, ref, entropy = batch_with_ref(3, B=12)
    kw = dict(**CLIP, veto_threshold=1e-4, loss_agg=agg, loss_agg_norm=NORM, kl_coef=0.2,
              kl_estimator="k3", entropy_coef=0.1)
    full_logp = logp.clone().requires_grad_()
    full_ent = entropy.clone().requires_grad_()
    full, m_full = policy_loss(full_logp, behav, adv, resp, ref_logp=ref, entropy=full_ent, **kw)
    full.backward()
    split_logp = logp.clone().requires_grad_()
    split_ent = entropy.clone().requires_grad_()
    counts = dict(num_tokens=int(resp.sum()), num_sequences=int(resp.any(1).sum()))
    total, parts = 0.0, []
    for idx in (slice(0, 1), slice(1, 7), slice(7, 12)):
        part, m = policy_loss(split_logp[idx], behav[idx], adv[idx], resp[idx], ref_logp=ref[idx],
                              entropy=split_ent[idx], **counts, **kw)
        total = total + part
        parts.append({**m, "loss": part.detach()})
    total.backward()
    assert float(total.detach()) == pytest.approx(float(full.detach()), rel=1e-12, abs=1e-14)
    assert torch.allclose(split_logp.grad, full_logp.grad, rtol=1e-10, atol=1e-14)
    assert torch.allclose(split_ent.grad, full_ent.grad, rtol=1e-10, atol=1e-14)
    combined = combine_metrics(parts)
    for key in ("pg_loss", "kl_loss", "entropy_loss", "kl_mean"):
        assert combined[key] == pytest.approx(float(m_full[key]), rel=1e-6, abs=1e-9), key
    assert 0 < combined["kl_share"] < 1


def test_seq_mean_modes_weigh_responses_not_tokens():
    """Two responses, one 1 token long and one 4: token-mean weighs the long one 4x; seq-mean-
    token-mean weighs them equally; seq-mean-token-sum by their lengths over 2 responses."""
    resp = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    zeros = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)  # rho = 1: each token's surrogate is 1
    got = {agg: -float(policy_loss(zeros, zeros, adv, resp, **CLIP, loss_agg=agg,
                                   loss_agg_norm=4.0)[0]) for agg in LOSS_AGGREGATIONS}
    assert got == pytest.approx({"token-mean": 1.0, "seq-mean-token-mean": 1.0,
                                 "seq-mean-token-sum": 2.5, "seq-mean-token-sum-norm": 2.5 / 4})


def test_kl_off_adds_nothing_and_needs_no_reference():
    logp, behav, adv, resp = random_batch(5)
    base, m0 = policy_loss(logp, behav, adv, resp, **CLIP, veto_threshold=1e-4)
    off, m1 = policy_loss(logp, behav, adv, resp, **CLIP, veto_threshold=1e-4, kl_coef=0.0)
    assert torch.equal(base, off) and "kl_loss" not in m1 and "kl_mean" not in m1
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, behav, adv, resp, **CLIP, kl_coef=0.1)
    # KL to the behaviour policy: k1 against the stored log-probs is the mean log rho
    _, m = policy_loss(logp, behav, adv, resp, **CLIP, kl_coef=0.1, kl_estimator="k1",
                       ref_logp=behav)
    lr = (logp - behav)[resp]
    assert float(m["kl_mean"]) == pytest.approx(float(lr.mean()), rel=1e-6)


def test_entropy_is_a_bonus_only_with_its_gradient():
    """An entropy tensor without a gradient (the learner's scoring passes) only reports; with
    one, the bonus enters the loss and its gradient is -coef x weight on each kept token."""
    logp, behav, adv, resp = random_batch(6)
    ent = torch.rand(logp.shape, dtype=torch.float64)
    plain, _ = policy_loss(logp, behav, adv, resp, **CLIP)
    reported, m = policy_loss(logp, behav, adv, resp, **CLIP, entropy=ent, entropy_coef=0.5)
    assert torch.equal(plain, reported) and "entropy_loss" not in m and "entropy_mean" in m
    ent.requires_grad_()
    bonus, m = policy_loss(logp, behav, adv, resp, **CLIP, entropy=ent, entropy_coef=0.5)
    bonus.backward()
    n = int(resp.sum())
    assert torch.allclose(ent.grad, torch.where(resp, -0.5 / n, 0.0).double())
    assert float(bonus.detach()) == pytest.approx(float(plain) - 0.5 * float(ent[resp].sum()) / n)


def test_dr_grpo_advantages_are_the_reward_minus_the_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 0.5, 1.5, 0.5, 1.5])
    adv = group_advantages(rewards, 4, norm_by_std=False)
    want = [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, -0.5, 0.5, -0.5, 0.5]
    assert adv.tolist() == pytest.approx(want)
    std = group_advantages(rewards, 4)  # GRPO's divides the same by the group's std
    assert std[8:].tolist() == pytest.approx([a / (0.5773502691896258 + 1e-6) for a in want[8:]])


def test_overlong_penalty_is_dapo_s_linear_ramp():
    """DAPO eq. 13 with L_max = 20, L_cache = 8: 0 up to 12 tokens, then -(len - 12) / 8 x
    factor, -factor at the limit."""
    lengths = torch.tensor([1, 12, 13, 16, 20])
    got = overlong_penalty(lengths, max_new_tokens=20, buffer_tokens=8, factor=0.5).tolist()
    assert got == pytest.approx([0.0, 0.0, -0.5 / 8, -0.25, -0.5])
    assert overlong_penalty(lengths, 20, 0, 1.0).tolist() == [0.0] * 5


def _entropy_worker(rank: int, directory: str) -> None:
    """One of two TP ranks: the vocabulary-parallel entropy of its half of the logits and its
    gradient, against torch autograd on the whole vocabulary."""
    import torch.distributed as dist
    from helpers import gloo_world
    from megatron.core import parallel_state as mpu

    from mugrpo_megatron.learner.logits import PAD_LOGIT, vocab_parallel_entropy

    gloo_world(rank, 2, directory, minutes=5)
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 8, generator=g, dtype=torch.float64) * 3
    full[..., -1] = PAD_LOGIT  # a padded vocabulary entry, as the learner sets them
    weights = torch.rand(3, 5, generator=g, dtype=torch.float64)
    ref = full.clone().requires_grad_()
    p = torch.softmax(ref, -1)
    want = -(p * torch.log_softmax(ref, -1)).nan_to_num().sum(-1)
    (want * weights).sum().backward()
    mine = full[..., rank * 4:(rank + 1) * 4].clone().requires_grad_()
    got = vocab_parallel_entropy(mine, grad=True)
    (got * weights).sum().backward()
    ok = torch.allclose(got, want, atol=1e-12) and \
        torch.allclose(mine.grad, ref.grad[..., rank * 4:(rank + 1) * 4], atol=1e-12)
    no_grad = vocab_parallel_entropy(mine.detach())
    ok = ok and torch.allclose(no_grad, want, atol=1e-12) and not no_grad.requires_grad
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 3)


@pytest.mark.slow
def test_vocab_parallel_entropy_gradient_at_tp2(tmp_path):
    """The entropy bonus's gradient through the vocabulary-parallel entropy, each of two TP
    ranks holding half the vocabulary (a padded entry included), equals torch's on the whole
    vocabulary; the backward issues no collective of its own."""
    from helpers import spawn_ranks

    assert spawn_ranks(_entropy_worker, str(tmp_path), ranks=2, timeout=300) == [0, 0]


def verl_vanilla(logp, behav, adv, resp, clip_low, clip_high, clip_ratio_c=3.0):
    """verl's ``compute_policy_loss_vanilla`` (core_algos.py, 2026), written from its formula
    with token-mean aggregation: the log-ratio clamped to +-20, the PPO clip, and for A < 0 the
    dual clip min(-A * c, max(-A * rho, -A * clip(rho))). A token at a time."""
    B, T = len(logp), len(logp[0])
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            if not resp[b][t]:
                continue
            rho = math.exp(min(max(logp[b][t] - behav[b][t], -20.0), 20.0))
            a = adv[b]
            loss = max(-a * rho, -a * min(max(rho, 1 - clip_low), 1 + clip_high))
            if a < 0:
                loss = min(-a * clip_ratio_c, loss)
            total, count = total + loss, count + 1
    return total / max(count, 1)


@pytest.mark.parametrize("clip", [dict(clip_low=0.2, clip_high=0.28), dict(clip_low=1.0,
                                                                            clip_high=4.0)])
def test_verl_s_dual_clip_and_log_ratio_clamp_are_options(clip):
    """Our loss equals verl's vanilla loss with clip_ratio_c 3 and the +-20 clamp on (value and
    gradient, log-ratios out to +-60); without them it differs where they act (the dual clip on
    A < 0 tokens past c, the clamp past 20), as issue 42 measured: a token with A < 0 and a
    log-ratio near 40 dominates the update without them."""
    for seed in range(4):
        logp, behav, adv, resp = random_batch(seed, spread=20.0)  # log-ratios to about +-60
        logp = logp.clone().requires_grad_(True)
        ours, m = policy_loss(logp, behav, adv, resp, **clip, clip_ratio_c=3.0,
                              log_ratio_clamp=20.0)
        ours.backward()
        lists = [x.tolist() for x in (logp.detach(), behav, adv, resp)]
        want = verl_vanilla(*lists, **clip)
        assert float(ours) == pytest.approx(want, rel=1e-10, abs=1e-12)
        # the gradient by finite differences of verl's formula, at 12 tokens
        g = torch.Generator().manual_seed(seed)
        for _ in range(12):
            b, t = int(torch.randint(len(adv), (1,), generator=g)), int(
                torch.randint(logp.shape[1], (1,), generator=g))
            h = 1e-6
            up, down = [row[:] for row in lists[0]], [row[:] for row in lists[0]]
            up[b][t] += h
            down[b][t] -= h
            numeric = (verl_vanilla(up, *lists[1:], **clip)
                       - verl_vanilla(down, *lists[1:], **clip)) / (2 * h)
            assert float(logp.grad[b, t]) == pytest.approx(numeric, abs=1e-6), (seed, b, t)
        assert 0 < m["clip_frac_dual"] < 1
        plain, _ = policy_loss(logp.detach(), behav, adv, resp, **clip)
        assert not math.isclose(float(plain), want, rel_tol=1e-6)  # they act on this batch
    with pytest.raises(ValueError, match="algo.clip_ratio_c: must be > 1"):
        from mugrpo_megatron.config import AlgoConfig

        AlgoConfig(clip_ratio_c=1.0)

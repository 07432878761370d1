"""The objective against naive per-token Python loops, and its batch-split invariance."""

import math

import pytest
import torch

from mugrpo_megatron.loss_metrics import (
    LOSS_PARTS,
    METRIC_COUNTS,
    METRIC_WEIGHTS,
    combine_metrics,
    metric_sums,
    metrics_from_sums,
)
from mugrpo_megatron.objective import VETO_SCOPES, group_advantages, policy_loss, veto_mask


def naive_group_advantages(rewards, group_size, eps=1e-6):
    out = []
    for g in range(0, len(rewards), group_size):
        grp = rewards[g:g + group_size]
        mean = sum(grp) / len(grp)
        if all(r == grp[0] for r in grp):
            out += [0.0] * len(grp)
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (len(grp) - 1))
        out += [(r - mean) / (std + eps) for r in grp]
    return out


PREFIX_BOUND = 6.0  # B of the prefix scope in these tests: crossed by a few wide log-ratios


def naive_keep(log_ratio, adv, resp, threshold, scope, prefix_bound=PREFIX_BOUND):
    B, T = len(log_ratio), len(log_ratio[0])
    keep = [[bool(resp[b][t]) for t in range(T)] for b in range(B)]
    if scope == "none":
        return keep
    for b in range(B):
        if not adv[b] < 0:
            continue
        if scope == "prefix":  # the running sum of the response's log-ratios so far
            running, crossed = 0.0, None
            for t in range(T):
                if resp[b][t]:
                    if crossed is not None:
                        keep[b][t] = False
                    running += log_ratio[b][t]
                    if crossed is None and running < -prefix_bound:
                        crossed = t
            continue
        triggers = [t for t in range(T) if resp[b][t] and log_ratio[b][t] < math.log(threshold)]
        if not triggers:
            continue
        kappa = triggers[0]
        for t in range(T):
            if not resp[b][t]:
                continue
            if scope == "trigger" and t in triggers:
                keep[b][t] = False
            elif scope == "suffix" and t > kappa:
                keep[b][t] = False
            elif scope == "suffix_no_trigger" and t > kappa and t not in triggers:
                keep[b][t] = False
            elif scope == "sequence":
                keep[b][t] = False
    return keep


def naive_loss(logp, behav, adv, resp, clip_low, clip_high, threshold, scope, num_tokens=None):
    B, T = len(logp), len(logp[0])
    lr = [[(logp[b][t] - behav[b][t]) if resp[b][t] else 0.0 for t in range(T)] for b in range(B)]
    keep = naive_keep(lr, adv, resp, threshold, scope) if threshold else [
        [bool(resp[b][t]) for t in range(T)] for b in range(B)]
    total, clipped, kept = 0.0, 0, 0
    for b in range(B):
        for t in range(T):
            if not keep[b][t]:
                continue
            rho = math.exp(lr[b][t])
            rho_c = min(max(rho, 1 - clip_low), 1 + clip_high)
            s1, s2 = rho * adv[b], rho_c * adv[b]
            total += min(s1, s2)
            clipped += s2 < s1
            kept += 1
    den = num_tokens if num_tokens is not None else sum(sum(map(bool, row)) for row in resp)
    return -total / max(den, 1), clipped / max(kept, 1), keep


def random_batch(seed, B=12, T=17, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    # Spread the log-ratios widely so that triggers at 1e-4 (log = -9.2) and clipping both occur.
    behav = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    start = torch.randint(0, 3, (B,), generator=g)
    pos = torch.arange(T)
    resp = (pos[None] >= start[:, None]) & (pos[None] < (start + lengths).clamp(max=T)[:, None])
    return logp, behav, adv, resp


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_group_advantages_matches_naive(group_size):
    g = torch.Generator().manual_seed(group_size)
    rewards = torch.randint(0, 3, (group_size * 6,), generator=g).double() / 2
    rewards[:group_size] = 1.0  # one uniform group for sure
    got = group_advantages(rewards, group_size)
    want = naive_group_advantages(rewards.tolist(), group_size)
    assert got.shape == rewards.shape
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert torch.equal(got[:group_size], torch.zeros(group_size, dtype=torch.float64))


def test_group_advantages_uniform_group_never_nan():
    rewards = torch.full((8,), 0.1, dtype=torch.float32)  # mean is inexact in binary
    out = group_advantages(rewards, 4)
    assert torch.equal(out, torch.zeros(8))
    assert not torch.isnan(group_advantages(torch.ones(3), 1)).any()
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(5), 2)


@pytest.mark.parametrize("scope", VETO_SCOPES)
@pytest.mark.parametrize("seed", range(5))
def test_veto_mask_matches_naive(scope, seed):
    logp, behav, adv, resp = random_batch(seed, spread=7.0)  # triggers at 1e-4 in every batch
    log_ratio = logp - behav
    got = veto_mask(log_ratio, adv, resp, 1e-4, scope, PREFIX_BOUND)
    want = naive_keep(log_ratio.tolist(), adv.tolist(), resp.tolist(), 1e-4, scope)
    assert got.dtype == torch.bool
    assert got.tolist() == want
    assert not (got & ~resp).any()
    if scope != "none":  # the batch exercises the scope: some tokens of A < 0 responses leave
        assert (resp & ~got).any()


def test_veto_mask_semantics_by_hand():
    # one negative response: triggers at positions 2 and 4; padding at 0 and 6
    lr = torch.tensor([[-20.0, 0.0, -12.0, 0.1, -11.0, 0.2, -30.0]])
    resp = torch.tensor([[False, True, True, True, True, True, False]])
    neg = torch.tensor([-1.0])
    T, F = True, False
    assert veto_mask(lr, neg, resp, 1e-4, "suffix").tolist() == [[F, T, T, F, F, F, F]]
    assert veto_mask(lr, neg, resp, 1e-4, "trigger").tolist() == [[F, T, F, T, F, T, F]]
    assert veto_mask(lr, neg, resp, 1e-4, "suffix_no_trigger").tolist() == [[F, T, T, F, T, F, F]]
    assert veto_mask(lr, neg, resp, 1e-4, "sequence").tolist() == [[F, F, F, F, F, F, F]]
    assert veto_mask(lr, neg, resp, 1e-4, "none").tolist() == resp.tolist()
    # positive and zero advantages are never masked
    for a in (1.0, 0.0):
        assert veto_mask(lr, torch.tensor([a]), resp, 1e-4, "sequence").tolist() == resp.tolist()
    with pytest.raises(ValueError, match="veto scope"):
        veto_mask(lr, neg, resp, 1e-4, "prefixes")
    # prefix: the running sum over the response is 0, -12, -11.9, -22.9, -22.7; it first falls
    # below -15 at position 4, below -5 at position 2, never below -25 (the padding's -30 and
    # -20 do not count)
    assert veto_mask(lr, neg, resp, 1e-4, "prefix", 15.0).tolist() == [[F, T, T, T, T, F, F]]
    assert veto_mask(lr, neg, resp, 1e-4, "prefix", 5.0).tolist() == [[F, T, T, F, F, F, F]]
    assert veto_mask(lr, neg, resp, 1e-4, "prefix", 25.0).tolist() == resp.tolist()
    with pytest.raises(ValueError, match="prefix bound"):
        veto_mask(lr, neg, resp, 1e-4, "prefix")


@pytest.mark.parametrize("scope", VETO_SCOPES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (1.0, 4.0), (0.2, 0.28)])
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_matches_naive(scope, clip, seed):
    logp, behav, adv, resp = random_batch(seed + 10)
    loss, metrics = policy_loss(logp, behav, adv, resp, clip_low=clip[0], clip_high=clip[1],
                                veto_threshold=1e-4, veto_scope=scope,
                                veto_prefix_bound=PREFIX_BOUND)
    want, clip_frac, keep = naive_loss(logp.tolist(), behav.tolist(), adv.tolist(), resp.tolist(),
                                       clip[0], clip[1], 1e-4, scope)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert metrics["clip_frac"].item() == pytest.approx(clip_frac, abs=1e-6)
    num_resp = resp.sum().item()
    num_kept = sum(map(sum, keep))
    assert metrics["veto_frac"].item() == pytest.approx((num_resp - num_kept) / num_resp, abs=1e-6)
    lr = (logp - behav)[resp]
    assert metrics["abs_log_ratio_mean"].item() == pytest.approx(lr.abs().mean().item(), rel=1e-6)
    neg = resp & (adv < 0)[:, None]
    rho_neg = torch.exp((logp - behav)[neg]).mean().item()
    assert metrics["rho_neg_mean"].item() == pytest.approx(rho_neg, rel=1e-5)
    # the drift numbers of A < 0 tokens, by a loop over them
    neg_lr = [(lp - bh) for row_lp, row_bh, row_r, a in zip(logp.tolist(), behav.tolist(),
                                                            resp.tolist(), adv.tolist())
              for lp, bh, r in zip(row_lp, row_bh, row_r) if r and a < 0]
    assert metrics["log_rho_neg_mean"].item() == pytest.approx(sum(neg_lr) / len(neg_lr),
                                                               rel=1e-6)
    below = sum(math.exp(x) < 0.5 for x in neg_lr) / len(neg_lr)
    assert metrics["rho_neg_below_half_frac"].item() == pytest.approx(below, abs=1e-7)
    negatives = [any(r) and a < 0 for row, r, a in zip(keep, resp.tolist(), adv.tolist())]
    vetoed = [any(r and not k for k, r in zip(krow, rrow)) for krow, rrow in zip(keep, resp.tolist())]
    want_vetoed = sum(v and n for v, n in zip(vetoed, negatives)) / sum(negatives)
    assert metrics["veto_response_frac"].item() == pytest.approx(want_vetoed, abs=1e-7)


def test_policy_loss_no_veto_and_clip_triggers():
    logp, behav, adv, resp = random_batch(3, spread=0.5)
    loss, m = policy_loss(logp, behav, adv, resp, clip_low=0.2, clip_high=0.2)
    want, clip_frac, _ = naive_loss(logp.tolist(), behav.tolist(), adv.tolist(), resp.tolist(),
                                    0.2, 0.2, None, "none")
    assert loss.item() == pytest.approx(want, rel=1e-10)
    assert m["veto_frac"].item() == 0.0
    assert 0.05 < clip_frac < 0.95  # the batch really exercises the clip


def test_gradient_flows_only_through_logp():
    logp, behav, adv, resp = random_batch(4)
    logp.requires_grad_(True)
    behav.requires_grad_(True)
    adv.requires_grad_(True)
    loss, _ = policy_loss(logp, behav, adv, resp, clip_low=1.0, clip_high=4.0, veto_threshold=1e-4)
    loss.backward()
    assert behav.grad is None and adv.grad is None
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~resp] == 0).all()


def test_garbage_in_padding_does_not_poison_gradient():
    logp, behav, adv, resp = random_batch(5)
    behav = behav.masked_fill(~resp, -1e30)
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, behav, adv, resp, clip_low=1.0, clip_high=4.0, veto_threshold=1e-4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("scope", ["suffix", "sequence"])
def test_microbatch_split_with_global_num_tokens_reproduces_full_batch(scope):
    logp, behav, adv, resp = random_batch(6, B=16)
    kw = dict(clip_low=1.0, clip_high=4.0, veto_threshold=1e-4, veto_scope=scope)
    full = logp.clone().requires_grad_(True)
    loss_full, m_full = policy_loss(full, behav, adv, resp, **kw)
    loss_full.backward()

    split = logp.clone().requires_grad_(True)
    num_tokens = int(resp.sum())
    total, parts = 0.0, []
    for idx in (slice(0, 3), slice(3, 9), slice(9, 16)):  # uneven microbatches
        loss_mb, m = policy_loss(split[idx], behav[idx], adv[idx], resp[idx], num_tokens=num_tokens,
                                 **kw)
        loss_mb.backward()
        total += loss_mb.item()
        parts.append(m)
    assert total == pytest.approx(loss_full.item(), rel=1e-12)
    assert torch.allclose(split.grad, full.grad, rtol=0, atol=1e-14)
    combined = combine_metrics(parts)
    for k, v in m_full.items():
        assert combined[k] == pytest.approx(v.item(), rel=1e-5, abs=1e-7), k
    # the learner's path: each rank sums its own microbatches, the sums are all-reduced (added),
    # then turned into metrics; the same numbers, and the microbatch losses add up to the loss
    for p, idx in zip(parts, (slice(0, 3), slice(3, 9), slice(9, 16))):
        p["loss"] = policy_loss(logp[idx], behav[idx], adv[idx], resp[idx], num_tokens=num_tokens,
                                **kw)[0].detach()
    rank_sums = metric_sums(parts[:1]) + metric_sums(parts[1:])
    peak = max(float(p["abs_log_ratio_max"]) for p in parts)
    reduced = metrics_from_sums(rank_sums, peak)
    assert reduced == pytest.approx({**combine_metrics(parts)}, rel=1e-12)
    assert reduced["loss"] == pytest.approx(loss_full.item(), rel=1e-12)
    # a rank without the loss: its counts are 0, and a mean over nothing is absent, not 0
    alone = metrics_from_sums(metric_sums([]), 0.0)
    assert alone["num_tokens"] == 0.0 and not set(METRIC_WEIGHTS) & set(alone)


def test_a_mean_over_nothing_is_absent_and_entropy_is_reported():
    """An update without an A < 0 token has no E[rho | A < 0] (nor any other mean over A < 0
    tokens): absent, not 0; the entropy a caller gives is averaged over the response tokens."""
    logp, behav, adv, resp = random_batch(8)
    entropy = torch.rand(logp.shape, dtype=torch.float64)
    _, m = policy_loss(logp, behav, adv.abs() + 0.1, resp, clip_low=1.0, clip_high=4.0,
                       veto_threshold=1e-4, entropy=entropy)
    got = combine_metrics([m])
    for name in ("rho_neg_mean", "rho_neg_kept_mean", "log_rho_neg_mean",
                 "rho_neg_below_half_frac", "veto_response_frac"):
        assert name not in got, name
    assert got["entropy_mean"] == pytest.approx(entropy[resp].mean().item(), rel=1e-6)
    assert "entropy_mean" not in combine_metrics([policy_loss(
        logp, behav, adv, resp, clip_low=1.0, clip_high=4.0)[1]])


def test_relaxed_clip_bounds():
    # clip_low=1, clip_high=4 is the ratio range [0, 5]
    logp = torch.log(torch.tensor([[0.5, 7.0, 1.0]]))
    behav = torch.zeros(1, 3)
    resp = torch.ones(1, 3, dtype=torch.bool)
    for a, want in ((1.0, -(0.5 + 5.0 + 1.0) / 3), (-1.0, (0.5 + 7.0 + 1.0) / 3)):
        loss, m = policy_loss(logp, behav, torch.tensor([a]), resp, clip_low=1.0, clip_high=4.0)
        assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["clip_frac"].item() == 0.0


def test_metric_sums_are_the_numbers_read_one_by_one():
    """metric_sums stays on the tensors' device (the learner reads an update's metrics once) and
    gives bit for bit what reading each value to a Python float and adding them up gave."""
    logp, behav, adv, resp = random_batch(7, B=12)
    parts = []
    for idx in (slice(0, 5), slice(5, 6), slice(6, 12)):
        loss, m = policy_loss(logp[idx].float(), behav[idx].float(), adv[idx].float(), resp[idx],
                              clip_low=1.0, clip_high=4.0, veto_threshold=1e-4,
                              num_tokens=int(resp.sum()))
        parts.append({**m, "loss": loss.detach()})
    one_by_one = torch.zeros(len(METRIC_COUNTS) + len(METRIC_WEIGHTS) + len(LOSS_PARTS),
                             dtype=torch.float64)
    for p in parts:  # the old reads: a float() per value
        one_by_one += torch.tensor([float(p.get(c, 0.0)) for c in METRIC_COUNTS]
                                   + [float(p[n]) * float(p[w]) if n in p else 0.0
                                      for n, w in METRIC_WEIGHTS.items()]
                                   + [float(p.get(n, 0.0)) for n in LOSS_PARTS],
                                   dtype=torch.float64)
    assert torch.equal(metric_sums(parts), one_by_one)
    got = metrics_from_sums(metric_sums(parts).tolist(), 0.5)
    assert got == metrics_from_sums(one_by_one, 0.5)

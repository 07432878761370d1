"""The Mu-GRPO objective: group advantages, the negative-advantage veto, the clipped policy loss,
and the GRPO family's terms around it (loss aggregation, KL to a reference or to the behaviour
policy, an entropy bonus, DAPO's overlong penalty).

Pure torch, no distributed state, so that every learner layout calls the same code and the tests
can check it against a per-token Python loop. The formulas follow verl's ``core_algos``
(``agg_loss``, ``kl_penalty_forward``; read at verl commit b178a3cd5) and DAPO (Yu et al. 2025);
where ours differ, the docstring says how.

Shapes: ``B`` responses, ``T`` token positions (padded). ``*_bt`` tensors are ``[B, T]``.
"""

from __future__ import annotations

import math

import torch

from mugrpo_megatron import chunked

VETO_SCOPES: tuple[str, ...] = ("none", "trigger", "suffix", "suffix_no_trigger", "sequence", "prefix")
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm")
"""How token losses become the minibatch's loss (verl's ``loss_agg_mode`` names)."""
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
"""Schulman's estimators of KL(pi_theta || pi_ref) from the sampled token's log-probs: verl's
``kl`` / ``mse`` / ``low_var_kl``."""
K3_LOG_RATIO_CLAMP = 20.0
"""k3 clamps log(pi_ref / pi_theta) to +-20 before exponentiating (verl, TRL)..."""
K3_CLAMP = 10.0
"""...and the estimate to [-10, 10]: a token beyond either clamp adds a constant (no gradient)."""


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                     norm_by_std: bool = True) -> torch.Tensor:
    """GRPO advantages: ``(r - group mean) / (group std + eps)`` per group; with ``norm_by_std``
    False, Dr.GRPO's ``r - group mean`` (verl's ``norm_adv_by_std_in_grpo: false``).

    Groups are consecutive runs of ``group_size`` elements of ``rewards`` (flattened). The std is
    the sample std (Bessel-corrected), as verl and TRL compute it. A group whose rewards are all
    equal (including ``group_size == 1``) carries no signal and gets exactly zero. The result is
    finite: non-finite rewards, or rewards so large that their variance overflows, raise ValueError.
    Returns a float tensor with the shape of ``rewards``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size})"
        )
    r_gk = rewards.reshape(-1, group_size).to(torch.float64)
    if not torch.isfinite(r_gk).all():
        bad = int((~torch.isfinite(r_gk)).any(dim=1).nonzero()[0])
        raise ValueError(f"group {bad} has a non-finite reward: {r_gk[bad].tolist()}")
    mean_g = r_gk.mean(dim=1, keepdim=True)
    if group_size > 1:
        std_g = r_gk.std(dim=1, keepdim=True)
    else:
        std_g = torch.zeros_like(mean_g)
    adv_gk = (r_gk - mean_g) / (std_g + eps) if norm_by_std else r_gk - mean_g
    uniform_g = (r_gk.amax(dim=1, keepdim=True) == r_gk.amin(dim=1, keepdim=True))
    adv_gk = torch.where(uniform_g, torch.zeros_like(adv_gk), adv_gk)
    if not torch.isfinite(adv_gk).all():  # the squares of rewards near 1e154 overflow
        bad = int((~torch.isfinite(adv_gk)).any(dim=1).nonzero()[0])
        raise ValueError(f"group {bad}: rewards {r_gk[bad].tolist()} are too large to normalise")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv_gk.reshape(rewards.shape).to(out_dtype)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int,
                     factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's ``overlong_buffer``): 0 for
    a response of at most ``max_new_tokens - buffer_tokens`` tokens, then falling linearly to
    ``-factor`` at ``max_new_tokens`` (the longest a response can be here: longer ones are cut
    there, so DAPO's -1 beyond the limit is the value at it). Added to the reward before
    advantages. float64, the shape of ``lengths``; zeros when ``buffer_tokens`` is 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if buffer_tokens <= 0:
        return torch.zeros_like(lengths)
    exceed = lengths - (max_new_tokens - buffer_tokens)
    return torch.clamp(-exceed / buffer_tokens * factor, max=0.0)


def check_veto(threshold: float, scope: str, prefix_bound: float | None) -> None:
    """ValueError for a veto ``veto_mask`` cannot apply."""
    if scope not in VETO_SCOPES:
        raise ValueError(f"veto scope must be one of {VETO_SCOPES}, got {scope!r}")
    if not threshold > 0:
        raise ValueError(f"veto threshold must be > 0, got {threshold}")
    if scope == "prefix" and not (prefix_bound is not None and prefix_bound > 0):
        raise ValueError(f"veto scope 'prefix' needs a prefix bound > 0, got {prefix_bound}")


def veto_mask(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
    scope: str = "suffix",
    prefix_bound: float | None = None,
) -> torch.Tensor:
    """Which tokens stay in the loss under the negative-advantage veto.

    ``log_ratio`` ``[B, T]`` is log(pi_theta / pi_behav); ``advantages`` ``[B]``; ``response_mask``
    ``[B, T]`` bool. A trigger is a response token of a response with A < 0 whose log-ratio is
    below log(threshold); kappa is the first trigger's position. ``scope``:

    - ``"none"``: mask nothing;
    - ``"trigger"``: mask every trigger token (the paper's T);
    - ``"suffix"``: mask the response tokens strictly after kappa (S_kappa, the default);
    - ``"suffix_no_trigger"``: mask S_kappa minus the trigger tokens (H_kappa);
    - ``"sequence"``: mask the whole response once it has a trigger (S_seq);
    - ``"prefix"``: a trust region on the prefix ratio: kappa is the first response token at
      which the running sum of log-ratios (the log of the prefix's ratio, pi_theta / pi_behav of
      the whole response so far) falls below ``-prefix_bound``, and the tokens strictly after it
      are masked. The paper's prefix-support argument (every later token's context has that
      small a ratio) without a single-token trigger: many moderately unlikely tokens cross it as
      one very unlikely token does; ``threshold`` is not used.

    Returns bool ``[B, T]``: True where the token stays. Tokens outside ``response_mask`` are False.
    """
    check_veto(threshold, scope, prefix_bound)
    response_bt = response_mask.bool()
    if scope == "none":
        return response_bt.clone()
    negative_b1 = (advantages < 0).reshape(-1, 1)
    if scope == "prefix":
        prefix_bt = torch.cumsum(torch.where(response_bt, log_ratio.detach().double(),
                                             torch.zeros((), dtype=torch.float64,
                                                         device=log_ratio.device)), dim=1)
        crossed_bt = response_bt & negative_b1 & (prefix_bt < -prefix_bound)
        before_bt = torch.cumsum(crossed_bt.to(torch.int32), dim=1) - crossed_bt.to(torch.int32)
        return response_bt & ~(before_bt > 0)
    trigger_bt = response_bt & negative_b1 & (log_ratio.detach() < math.log(threshold))
    triggers_before_bt = torch.cumsum(trigger_bt.to(torch.int32), dim=1) - trigger_bt.to(torch.int32)
    after_kappa_bt = triggers_before_bt > 0  # strictly after the first trigger
    return response_bt & ~chunked.scope_masked(scope, trigger_bt, after_kappa_bt,
                                               trigger_bt.any(dim=1, keepdim=True))


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled token's log-probs (Schulman
    2020), as verl's ``kl_penalty_forward``: ``k1`` log(pi/pi_ref); ``k2`` 1/2 log(pi/pi_ref)^2;
    ``k3`` pi_ref/pi - log(pi_ref/pi) - 1, with log(pi_ref/pi) clamped to +-20 and the estimate to
    [-10, 10] (``K3_*_CLAMP``; beyond them the token's term is constant and passes no gradient)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp).square()
    if estimator == "k3":
        log_ref_ratio = torch.clamp(ref_logp - logp, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(log_ref_ratio) - log_ref_ratio - 1, -K3_CLAMP, K3_CLAMP)
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def sequence_weights(response_mask: torch.Tensor, agg: str,
                     lengths: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, 1]``: what each response's token losses are multiplied by before they are summed and
    divided by ``loss_denominator``: 1 for ``token-mean``, ``seq-mean-token-sum`` and
    ``seq-mean-token-sum-norm``, 1 / (the response's token count) for ``seq-mean-token-mean``.
    A response's count is its response tokens before the veto (the mask the engine gave), as
    verl's ``loss_mask``; a response with none weighs 0. ``lengths`` ``[B, 1]``: the counts,
    where the rows are split and ``response_mask`` holds only some of their columns."""
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {agg!r}")
    if agg != "seq-mean-token-mean":
        return torch.ones((response_mask.shape[0], 1), dtype=torch.float64,
                          device=response_mask.device)
    if lengths is None:
        lengths = response_mask.sum(dim=1, keepdim=True).to(torch.float64)
    return torch.where(lengths > 0, 1.0 / torch.clamp(lengths, min=1.0), torch.zeros_like(lengths))


def loss_denominator(agg: str, num_tokens, num_sequences, norm: float | None) -> torch.Tensor:
    """The minibatch's loss is sum(token loss x sequence weight) / this: its response tokens
    (``token-mean``), its responses (``seq-mean-token-mean``, ``seq-mean-token-sum``) or its
    responses x ``norm`` (``seq-mean-token-sum-norm``: Dr.GRPO's constant, the response-length
    limit by default). Counts are the whole minibatch's, over every microbatch and DP rank, so
    any split gives the one-big-batch value. verl divides ``seq-mean-token-sum-norm``'s sum by
    the constant alone, per microbatch, then scales by the microbatch's share (its value then
    depends on the split); ours is the mean over responses of each response's sum / ``norm``."""
    if agg == "token-mean":
        return torch.as_tensor(num_tokens)
    seqs = torch.as_tensor(num_sequences)
    if agg == "seq-mean-token-sum-norm":
        if not (norm and norm > 0):
            raise ValueError(f"seq-mean-token-sum-norm needs a positive norm, got {norm}")
        return seqs * norm
    return seqs


def policy_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float | None = None,
    ess_grid: tuple[float, ...] | None = None,
    veto_threshold: float | None = None,
    veto_scope: str = "suffix",
    veto_prefix_bound: float | None = None,
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
    loss_agg: str = "token-mean",
    loss_agg_norm: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    ref_logp: torch.Tensor | None = None,
    split: chunked.SequenceSplit | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped importance-sampled policy loss against stored behaviour log-probs, with the veto,
    and the optional KL and entropy terms.

    Per token: rho = exp(logp - behav_logp); surrogate = min(rho * A, clip(rho, 1 - clip_low,
    1 + clip_high) * A). The loss is, over the response tokens the veto keeps,

        sum(w * (-surrogate + kl_coef * KL - entropy_coef * H)) / denominator

    with w the response's ``sequence_weights`` and the denominator ``loss_denominator`` of
    ``loss_agg`` (``token-mean``: the minibatch's response tokens, before the veto). The counts
    are ``num_tokens`` and ``num_sequences`` when given (the whole minibatch's, over every
    microbatch and DP rank, so that any split gives the same gradient), else this call's.
    KL = ``kl_estimate(logp, ref_logp, kl_estimator)`` (``ref_logp``: a reference policy's
    log-probs, or the behaviour policy's for a trust region), taken when ``kl_coef`` > 0; H =
    ``entropy`` (the policy's entropy at each position), a bonus when ``entropy_coef`` > 0,
    when its gradient flows (else it is only reported). The KL and entropy terms are aggregated
    as the policy term is (verl: ``agg_loss`` with the same mode), over the tokens the veto
    keeps (verl has no veto: there, every response token). Gradients flow through ``logp`` (and
    ``entropy``). ``veto_threshold=None`` disables the veto (``veto_prefix_bound`` is the bound
    of scope 'prefix'). Relaxed clipping [0, 5] is clip_low=1, clip_high=4.

    verl's options, each off by default here (no paper's formula has them): ``clip_ratio_c``, the
    dual clip, surrogate = max(surrogate, clip_ratio_c * A) where A < 0; ``log_ratio_clamp``, the
    surrogate's ratio from the log-ratio clamped to +-it. With both at verl's 3 and 20 the loss
    is verl's ``compute_policy_loss_vanilla`` (``tests/test_loss_terms.py``). The veto and the
    metrics read the log-ratio as it is.

    ``ess_grid`` (``algo.clip_high: auto``): for each eps of it, the mean over the kept
    positive-advantage tokens of w = min(rho, 1 + eps) and of w^2 (``ess_capped_mean_i``,
    ``ess_capped_sq_mean_i`` over ``num_ess_tokens``), from which ``ess_fractions`` gives the
    update's effective sample size under each candidate clip.

    ``split`` (context parallelism): the tensors are this rank's columns of the rows, the rest
    on the other ranks of the split; the veto's first trigger, a response's token count
    (``seq-mean-token-mean``) and the per-response metrics are taken over the whole rows
    (``chunked``), so the ranks' losses and metrics add up to the whole rows' (the metrics of
    whole responses counted on the split's first rank).

    Metrics (0-dim detached float tensors): the means listed below over this call's tokens, and the
    ``num_*`` counts they were taken over, so that callers can combine microbatches exactly; and
    the loss's parts (``pg_loss``, ``kl_loss``, ``entropy_loss``: each already divided by the
    denominator, so they add up over microbatches). A mean over no token (no A < 0 token in the
    call, say) is 0 here with a count of 0; ``metrics_from_sums`` leaves it out.
    """
    response_bt = response_mask.bool()
    adv_b1 = advantages.detach().reshape(-1, 1).to(logp.dtype)
    behav_bt = behav_logp.detach().to(logp.dtype)
    # Padding may hold anything; zero it so exp() cannot make inf * 0 = NaN in the backward pass.
    log_ratio_bt = torch.where(response_bt, logp - behav_bt, torch.zeros_like(logp))
    rho_bt = torch.exp(log_ratio_bt)

    if veto_threshold is None:
        keep_bt = response_bt
    elif split is not None and veto_scope != "none":
        check_veto(veto_threshold, veto_scope, veto_prefix_bound)
        keep_bt = chunked.veto_mask_split(log_ratio_bt.detach(), adv_b1 < 0, response_bt,
                                          veto_threshold, veto_scope, veto_prefix_bound, split)
    else:
        keep_bt = veto_mask(log_ratio_bt.detach(), adv_b1.squeeze(1), response_bt, veto_threshold,
                            veto_scope, veto_prefix_bound)

    rho_loss_bt = rho_bt if log_ratio_clamp is None else torch.exp(
        torch.clamp(log_ratio_bt, -log_ratio_clamp, log_ratio_clamp))
    rho_clipped_bt = torch.clamp(rho_loss_bt, 1.0 - clip_low, 1.0 + clip_high)
    surr_bt = rho_loss_bt * adv_b1
    surr_clipped_bt = rho_clipped_bt * adv_b1
    surrogate_bt = torch.minimum(surr_bt, surr_clipped_bt)
    dual_bt = None
    if clip_ratio_c is not None:  # an A < 0 token's loss at most clip_ratio_c * |A|
        floor_b1 = clip_ratio_c * adv_b1
        dual_bt = (adv_b1 < 0) & (surrogate_bt < floor_b1)
        surrogate_bt = torch.where(adv_b1 < 0, torch.maximum(surrogate_bt, floor_b1), surrogate_bt)

    num_local = response_bt.sum()

    def count(given, local) -> torch.Tensor:  # at least 1: a minibatch of no token divides by 1
        value = local if given is None else torch.as_tensor(given)
        return torch.clamp(value.to(device=logp.device, dtype=logp.dtype), min=1.0)

    denom = loss_denominator(loss_agg, count(num_tokens, num_local),
                             count(num_sequences, response_bt.any(dim=1).sum()), loss_agg_norm)
    weight_b1 = sequence_weights(response_bt, loss_agg, None if split is None or loss_agg !=
                                 "seq-mean-token-mean" else chunked.row_counts(response_bt, split)
                                 ).to(logp.dtype)
    zero = torch.zeros_like(surrogate_bt)

    def aggregated(per_token: torch.Tensor) -> torch.Tensor:
        kept = torch.where(keep_bt, per_token, zero)
        return (kept if loss_agg == "token-mean" else kept * weight_b1).sum() / denom

    pg_loss = -aggregated(surrogate_bt)
    loss = pg_loss
    kl_bt = None
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference or behaviour log-probs)")
        ref_bt = torch.where(response_bt, ref_logp.detach().to(logp.dtype), logp.detach())
        kl_bt = torch.where(response_bt, kl_estimate(logp, ref_bt, kl_estimator), zero)
        kl_loss = kl_coef * aggregated(kl_bt)
        loss = loss + kl_loss
    entropy_loss = None
    if entropy_coef and entropy is not None and entropy.requires_grad:
        entropy_loss = -entropy_coef * aggregated(torch.where(response_bt, entropy, zero))
        loss = loss + entropy_loss

    with torch.no_grad():
        # A token is clipped when the clipped branch is strictly smaller: its gradient is zero
        # (one the dual clip floors counts as dual-clipped, not here).
        clipped_bt = keep_bt & (surr_clipped_bt < surr_bt)
        if dual_bt is not None:
            clipped_bt = clipped_bt & ~dual_bt
        clipped_low_bt = clipped_bt & (rho_bt < 1.0 - clip_low)
        neg_bt = response_bt & (adv_b1 < 0)
        neg_kept_bt = keep_bt & (adv_b1 < 0)
        num_kept = keep_bt.sum()
        num_neg = neg_bt.sum()
        num_neg_kept = neg_kept_bt.sum()
        neg_b, vetoed_b = neg_bt.any(dim=1), (neg_bt & ~keep_bt).any(dim=1)
        if split is not None:  # whole responses: over the split, counted on its first rank
            both = chunked.row_any(torch.stack([neg_b, vetoed_b]), split)
            neg_b, vetoed_b = both & (split.cp_rank == 0)
        num_neg_responses = neg_b.sum()
        vetoed_responses = vetoed_b.sum()
        metrics = {
            "clip_frac": _safe_div(clipped_bt.sum(), num_kept),
            "clip_frac_low": _safe_div(clipped_low_bt.sum(), num_kept),
            "clip_frac_high": _safe_div((clipped_bt & ~clipped_low_bt).sum(), num_kept),
            "clip_frac_dual": _safe_div((keep_bt & dual_bt).sum(), num_kept)
            if dual_bt is not None else num_kept.new_zeros((), dtype=torch.float64),
            "veto_frac": _safe_div(num_local - num_kept, num_local),
            "veto_response_frac": _safe_div(vetoed_responses, num_neg_responses),
            "rho_neg_mean": _safe_div((rho_bt * neg_bt).sum(), num_neg),
            "rho_neg_kept_mean": _safe_div((rho_bt * neg_kept_bt).sum(), num_neg_kept),
            "log_rho_neg_mean": _safe_div((log_ratio_bt * neg_bt).sum(), num_neg),
            "rho_neg_below_half_frac": _safe_div((neg_bt & (rho_bt < 0.5)).sum(), num_neg),
            "rho_mean": _safe_div((rho_bt * response_bt).sum(), num_local),
            "abs_log_ratio_mean": _safe_div(log_ratio_bt.abs().sum(), num_local),
            "abs_log_ratio_max": log_ratio_bt.abs().max() if logp.numel() else logp.new_zeros(()),
            "num_tokens": num_local.to(torch.float32),
            "num_kept_tokens": num_kept.to(torch.float32),
            "num_neg_tokens": num_neg.to(torch.float32),
            "num_neg_kept_tokens": num_neg_kept.to(torch.float32),
            "num_neg_responses": num_neg_responses.to(torch.float32),
            "pg_loss": pg_loss.detach(),
        }
        if entropy is not None:
            metrics["entropy_mean"] = _safe_div((entropy.detach() * response_bt).sum(), num_local)
            metrics["num_entropy_tokens"] = num_local.to(torch.float32)
        if kl_bt is not None:
            metrics["kl_mean"] = _safe_div((kl_bt.detach() * keep_bt).sum(), num_kept)
            metrics["num_kl_tokens"] = num_kept.to(torch.float32)
            metrics["kl_loss"] = kl_loss.detach()
        if entropy_loss is not None:
            metrics["entropy_loss"] = entropy_loss.detach()
            metrics["num_entropy_bonus_tokens"] = num_kept.to(torch.float32)
        if ess_grid is not None:
            pos_bt = keep_bt & (adv_b1 > 0)
            num_pos = pos_bt.sum()
            metrics["num_ess_tokens"] = num_pos.to(torch.float32)
            for i, eps in enumerate(ess_grid):
                w_bt = torch.clamp(rho_bt.detach(), max=1.0 + eps) * pos_bt
                metrics[f"ess_capped_mean_{i}"] = _safe_div(w_bt.sum(), num_pos)
                metrics[f"ess_capped_sq_mean_{i}"] = _safe_div((w_bt * w_bt).sum(), num_pos)
    return loss, {k: v.detach().to(torch.float32) for k, v in metrics.items()}


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    num = num.to(torch.float64)
    den = den.to(torch.float64)
    return torch.where(den > 0, num / torch.clamp(den, min=1.0), torch.zeros_like(num))


# How each mean metric of ``policy_loss`` is weighted when microbatches (or DP ranks) are combined.
METRIC_WEIGHTS: dict[str, str] = {
    "clip_frac": "num_kept_tokens",
    "clip_frac_low": "num_kept_tokens",
    "clip_frac_high": "num_kept_tokens",
    "clip_frac_dual": "num_kept_tokens",
    "veto_frac": "num_tokens",
    "veto_response_frac": "num_neg_responses",
    "rho_neg_mean": "num_neg_tokens",
    "rho_neg_kept_mean": "num_neg_kept_tokens",
    "log_rho_neg_mean": "num_neg_tokens",
    "rho_neg_below_half_frac": "num_neg_tokens",
    "rho_mean": "num_tokens",
    "abs_log_ratio_mean": "num_tokens",
    "entropy_mean": "num_entropy_tokens",
    "kl_mean": "num_kl_tokens",
    **{f"ess_capped_{m}_{i}": "num_ess_tokens" for i in range(8) for m in ("mean", "sq_mean")},
}


METRIC_COUNTS: tuple[str, ...] = ("num_tokens", "num_kept_tokens", "num_neg_tokens",
                                   "num_neg_kept_tokens", "num_neg_responses",
                                   "num_entropy_tokens", "num_kl_tokens",
                                   "num_entropy_bonus_tokens", "num_ess_tokens")
"""The token and response counts of ``policy_loss``'s metrics, which the means are weighted by."""
LOSS_PARTS: tuple[str, ...] = ("pg_loss", "kl_loss", "entropy_loss", "loss")
"""The loss and its parts: each microbatch's is already divided by the minibatch's denominator,
so they are summed, not averaged."""


def metric_sums(parts: list[dict[str, torch.Tensor]],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 ``[len(METRIC_COUNTS) + len(METRIC_WEIGHTS) + len(LOSS_PARTS)]``: each count, each
    mean times its weight, and the loss and its parts (where the parts carry them), summed over
    ``parts``. Sums of several ranks
    add up (an all-reduce SUM) to the sums of all their parts. Computed where the parts are
    (``device`` when there are none), without reading any value back to the host: on a GPU the
    learner reads the update's sums once, not ~15 values per microbatch."""
    names = (*METRIC_COUNTS, *METRIC_WEIGHTS, *LOSS_PARTS)
    if parts:
        device = parts[0]["num_tokens"].device
    out = torch.zeros(len(names), dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)  # a part without a metric
    for p in parts:  # in order, so the sums are the same numbers whatever the device
        out = out + torch.stack([p[c].double() if c in p else zero for c in METRIC_COUNTS]
                                + [p[n].double() * p[w].double() if n in p else zero
                                   for n, w in METRIC_WEIGHTS.items()]
                                + [p[n].double() if n in p else zero for n in LOSS_PARTS])
    return out


def metrics_from_sums(sums: torch.Tensor | list[float], abs_log_ratio_max: float
                      ) -> dict[str, float]:
    """The metrics of the union of the parts summed in ``sums`` (see ``metric_sums``; a tensor, or
    its values already read), and the summed loss: every microbatch's loss is already divided by
    the minibatch's denominator. A mean over nothing (its count is 0: no A < 0 token, no token
    kept, no entropy computed) is left out, not given as 0; so are the KL and entropy terms of a
    loss without them. ``kl_share``: the KL term's share of the loss's magnitude, |kl| / (|pg| +
    |kl| + |entropy|)."""
    sums = sums.tolist() if isinstance(sums, torch.Tensor) else list(sums)
    out = dict(zip(METRIC_COUNTS, sums))
    for j, (name, weight) in enumerate(METRIC_WEIGHTS.items()):
        den = out[weight]
        if den:
            out[name] = sums[len(METRIC_COUNTS) + j] / den
    losses = dict(zip(LOSS_PARTS, sums[len(METRIC_COUNTS) + len(METRIC_WEIGHTS):]))
    out["loss"], out["pg_loss"] = losses["loss"], losses["pg_loss"]
    if out["num_kl_tokens"]:
        out["kl_loss"] = losses["kl_loss"]
    if out["num_entropy_bonus_tokens"]:
        out["entropy_loss"] = losses["entropy_loss"]
    if "kl_loss" in out:
        size = abs(out["pg_loss"]) + abs(out["kl_loss"]) + abs(out.get("entropy_loss", 0.0))
        out["kl_share"] = abs(out["kl_loss"]) / size if size else 0.0
    out["abs_log_ratio_max"] = abs_log_ratio_max
    return out


def combine_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Combine ``policy_loss`` metrics of several microbatches as if computed on their union (in
    one process; the learner all-reduces ``metric_sums`` across ranks between the two steps)."""
    if not parts:
        return {}
    return metrics_from_sums(metric_sums(parts),
                             max(float(p["abs_log_ratio_max"]) for p in parts))


def ess_fractions(metrics: dict[str, float], grid: tuple[float, ...]) -> list[float | None]:
    """The effective sample size, as a share of the tokens, of the kept positive-advantage
    tokens' ratios capped at 1 + eps for each eps of ``grid``: (E w)^2 / E w^2 from an update's
    combined ``ess_capped_*`` metrics (``policy_loss(ess_grid=grid)``). None each where the
    update had no such token."""
    out: list[float | None] = []
    for i in range(len(grid)):
        m1, m2 = metrics.get(f"ess_capped_mean_{i}"), metrics.get(f"ess_capped_sq_mean_{i}")
        out.append(None if m1 is None or not m2 else m1 * m1 / m2)
    return out

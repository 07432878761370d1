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
from mugrpo_megatron.config.algo import (  # the knobs' values (there: no torch in the config)
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    VETO_SCOPES,
)
from mugrpo_megatron.loss_metrics import loss_metrics

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
    is_weight: torch.Tensor | None = None,
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

    ``is_weight`` (``algo.rollout_is``): a constant per-token weight on the policy term, w *
    surrogate (``rollout_correction``: TIS from the engine's sampling to the behaviour policy).

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
    log_ratio_bt, rho_bt = importance_ratio(logp, behav_logp, response_bt)
    keep_bt = kept_tokens(log_ratio_bt, adv_b1, response_bt, veto_threshold, veto_scope,
                          veto_prefix_bound, split)
    surrogate_bt, surr_bt, surr_clipped_bt, dual_bt = clipped_surrogate(
        log_ratio_bt, adv_b1, clip_low, clip_high, clip_ratio_c, log_ratio_clamp)

    def count(given, local) -> torch.Tensor:  # at least 1: a minibatch of no token divides by 1
        value = local if given is None else torch.as_tensor(given)
        return torch.clamp(value.to(device=logp.device, dtype=logp.dtype), min=1.0)

    denom = loss_denominator(loss_agg, count(num_tokens, response_bt.sum()),
                             count(num_sequences, response_bt.any(dim=1).sum()), loss_agg_norm)
    weight_b1 = sequence_weights(response_bt, loss_agg, None if split is None or loss_agg !=
                                 "seq-mean-token-mean" else chunked.row_counts(response_bt, split)
                                 ).to(logp.dtype)

    def aggregated(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, keep_bt, weight_b1, denom, loss_agg)

    pg_loss = -aggregated(surrogate_bt if is_weight is None else
                          surrogate_bt * is_weight.detach().to(logp.dtype))
    loss = pg_loss
    kl_bt = kl_loss = entropy_loss = None
    zero = torch.zeros_like(surrogate_bt)
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the reference or behaviour log-probs)")
        ref_bt = torch.where(response_bt, ref_logp.detach().to(logp.dtype), logp.detach())
        kl_bt = torch.where(response_bt, kl_estimate(logp, ref_bt, kl_estimator), zero)
        kl_loss = kl_coef * aggregated(kl_bt)
        loss = loss + kl_loss
    if entropy_coef and entropy is not None and entropy.requires_grad:
        entropy_loss = -entropy_coef * aggregated(torch.where(response_bt, entropy, zero))
        loss = loss + entropy_loss
    with torch.no_grad():
        metrics = loss_metrics(
            log_ratio_bt, rho_bt, adv_b1, response_bt, keep_bt, surr_bt, surr_clipped_bt,
            dual_bt, clip_low, split, pg_loss=pg_loss, kl_bt=kl_bt, kl_loss=kl_loss,
            entropy=entropy, entropy_loss=entropy_loss, ess_grid=ess_grid)
    return loss, {k: v.detach().to(torch.float32) for k, v in metrics.items()}


def importance_ratio(logp: torch.Tensor, behav_logp: torch.Tensor, response_bt: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """log rho = log pi_theta - log pi_behav at the tokens of ``response_bt`` (0 elsewhere:
    padding and tool messages may hold anything, and exp() of it must not make inf * 0 = NaN in
    the backward pass), and rho."""
    behav_bt = behav_logp.detach().to(logp.dtype)
    log_ratio_bt = torch.where(response_bt, logp - behav_bt, torch.zeros_like(logp))
    return log_ratio_bt, torch.exp(log_ratio_bt)


def kept_tokens(log_ratio_bt: torch.Tensor, adv_b1: torch.Tensor, response_bt: torch.Tensor,
                threshold: float | None, scope: str, prefix_bound: float | None,
                split: chunked.SequenceSplit | None) -> torch.Tensor:
    """The tokens the loss keeps: ``response_bt`` less what the negative-advantage veto masks
    (``veto_mask``; over whole rows where they are ``split``); all of them without a veto."""
    if threshold is None:
        return response_bt
    if split is not None and scope != "none":
        check_veto(threshold, scope, prefix_bound)
        return chunked.veto_mask_split(log_ratio_bt.detach(), adv_b1 < 0, response_bt,
                                       threshold, scope, prefix_bound, split)
    return veto_mask(log_ratio_bt.detach(), adv_b1.squeeze(1), response_bt, threshold, scope,
                     prefix_bound)


def clipped_surrogate(log_ratio_bt: torch.Tensor, adv_b1: torch.Tensor, clip_low: float,
                      clip_high: float, clip_ratio_c: float | None,
                      log_ratio_clamp: float | None):
    """min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) per token, with verl's optional
    log-ratio clamp and dual clip (``policy_loss``); returns it, its two branches (for the clip
    metrics) and where the dual clip floored it (None without one)."""
    rho_bt = torch.exp(log_ratio_bt) if log_ratio_clamp is None else torch.exp(
        torch.clamp(log_ratio_bt, -log_ratio_clamp, log_ratio_clamp))
    surr_bt = rho_bt * adv_b1
    surr_clipped_bt = torch.clamp(rho_bt, 1.0 - clip_low, 1.0 + clip_high) * adv_b1
    surrogate_bt = torch.minimum(surr_bt, surr_clipped_bt)
    dual_bt = None
    if clip_ratio_c is not None:  # an A < 0 token's loss at most clip_ratio_c * |A|
        floor_b1 = clip_ratio_c * adv_b1
        dual_bt = (adv_b1 < 0) & (surrogate_bt < floor_b1)
        surrogate_bt = torch.where(adv_b1 < 0, torch.maximum(surrogate_bt, floor_b1), surrogate_bt)
    return surrogate_bt, surr_bt, surr_clipped_bt, dual_bt


def aggregate(per_token: torch.Tensor, keep_bt: torch.Tensor, weight_b1: torch.Tensor,
              denom: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """sum over the kept tokens of (sequence weight x token value) / denominator."""
    kept = torch.where(keep_bt, per_token, torch.zeros_like(per_token))
    return (kept if loss_agg == "token-mean" else kept * weight_b1).sum() / denom

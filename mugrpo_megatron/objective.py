"""The Mu-GRPO objective: group advantages, the negative-advantage veto, the clipped policy loss.

Pure torch, no distributed state, so that every learner layout calls the same code and the tests
can check it against a per-token Python loop.

Shapes: ``B`` responses, ``T`` token positions (padded). ``*_bt`` tensors are ``[B, T]``.
"""

from __future__ import annotations

import math

import torch

VETO_SCOPES: tuple[str, ...] = ("none", "trigger", "suffix", "suffix_no_trigger", "sequence", "prefix")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``(r - group mean) / (group std + eps)`` per group.

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
    adv_gk = (r_gk - mean_g) / (std_g + eps)
    uniform_g = (r_gk.amax(dim=1, keepdim=True) == r_gk.amin(dim=1, keepdim=True))
    adv_gk = torch.where(uniform_g, torch.zeros_like(adv_gk), adv_gk)
    if not torch.isfinite(adv_gk).all():  # the squares of rewards near 1e154 overflow
        bad = int((~torch.isfinite(adv_gk)).any(dim=1).nonzero()[0])
        raise ValueError(f"group {bad}: rewards {r_gk[bad].tolist()} are too large to normalise")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv_gk.reshape(rewards.shape).to(out_dtype)


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
    if scope not in VETO_SCOPES:
        raise ValueError(f"veto scope must be one of {VETO_SCOPES}, got {scope!r}")
    if not threshold > 0:
        raise ValueError(f"veto threshold must be > 0, got {threshold}")
    if scope == "prefix" and not (prefix_bound is not None and prefix_bound > 0):
        raise ValueError(f"veto scope 'prefix' needs a prefix bound > 0, got {prefix_bound}")
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
    if scope == "trigger":
        masked_bt = trigger_bt
    elif scope == "suffix":
        masked_bt = after_kappa_bt
    elif scope == "suffix_no_trigger":
        masked_bt = after_kappa_bt & ~trigger_bt
    else:  # "sequence"
        masked_bt = trigger_bt.any(dim=1, keepdim=True).expand_as(trigger_bt)
    return response_bt & ~masked_bt


def policy_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    veto_threshold: float | None = None,
    veto_scope: str = "suffix",
    veto_prefix_bound: float | None = None,
    num_tokens: int | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped importance-sampled policy loss against stored behaviour log-probs, with the veto.

    Per token: rho = exp(logp - behav_logp); surrogate = min(rho * A, clip(rho, 1 - clip_low,
    1 + clip_high) * A); loss = -sum(surrogate over response tokens kept by the veto) / denominator.
    The denominator is ``num_tokens`` when given (the global count of response tokens of the whole
    minibatch, before the veto, so that any split across microbatches and DP ranks gives the same
    gradient), else the local count of ``response_mask``. Gradients flow only through ``logp``.
    ``veto_threshold=None`` disables the veto (``veto_prefix_bound`` is the bound of scope
    'prefix'). Relaxed clipping [0, 5] is clip_low=1, clip_high=4. ``entropy`` ``[B, T]``, when
    given, is the policy's entropy at each position (no gradient), reported as ``entropy_mean``
    over the response tokens.

    Metrics (0-dim detached float tensors): the means listed below over this call's tokens, and the
    ``num_*`` counts they were taken over, so that callers can combine microbatches exactly. A
    mean over no token (no A < 0 token in the call, say) is 0 here with a count of 0;
    ``metrics_from_sums`` leaves it out.
    """
    response_bt = response_mask.bool()
    adv_b1 = advantages.detach().reshape(-1, 1).to(logp.dtype)
    behav_bt = behav_logp.detach().to(logp.dtype)
    # Padding may hold anything; zero it so exp() cannot make inf * 0 = NaN in the backward pass.
    log_ratio_bt = torch.where(response_bt, logp - behav_bt, torch.zeros_like(logp))
    rho_bt = torch.exp(log_ratio_bt)

    if veto_threshold is None:
        keep_bt = response_bt
    else:
        keep_bt = veto_mask(log_ratio_bt.detach(), adv_b1.squeeze(1), response_bt, veto_threshold,
                            veto_scope, veto_prefix_bound)

    rho_clipped_bt = torch.clamp(rho_bt, 1.0 - clip_low, 1.0 + clip_high)
    surr_bt = rho_bt * adv_b1
    surr_clipped_bt = rho_clipped_bt * adv_b1
    surrogate_bt = torch.minimum(surr_bt, surr_clipped_bt)

    num_local = response_bt.sum()
    denom = num_local if num_tokens is None else torch.as_tensor(num_tokens)
    denom = torch.clamp(denom.to(logp.dtype), min=1.0)
    loss = -torch.where(keep_bt, surrogate_bt, torch.zeros_like(surrogate_bt)).sum() / denom

    with torch.no_grad():
        # A token is clipped when the clipped branch is strictly smaller: its gradient is zero.
        clipped_bt = keep_bt & (surr_clipped_bt < surr_bt)
        clipped_low_bt = clipped_bt & (rho_bt < 1.0 - clip_low)
        neg_bt = response_bt & (adv_b1 < 0)
        neg_kept_bt = keep_bt & (adv_b1 < 0)
        num_kept = keep_bt.sum()
        num_neg = neg_bt.sum()
        num_neg_kept = neg_kept_bt.sum()
        num_neg_responses = (neg_bt.any(dim=1)).sum()
        vetoed_responses = (neg_bt & ~keep_bt).any(dim=1).sum()
        metrics = {
            "clip_frac": _safe_div(clipped_bt.sum(), num_kept),
            "clip_frac_low": _safe_div(clipped_low_bt.sum(), num_kept),
            "clip_frac_high": _safe_div((clipped_bt & ~clipped_low_bt).sum(), num_kept),
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
        }
        if entropy is not None:
            metrics["entropy_mean"] = _safe_div((entropy.detach() * response_bt).sum(), num_local)
            metrics["num_entropy_tokens"] = num_local.to(torch.float32)
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
    "veto_frac": "num_tokens",
    "veto_response_frac": "num_neg_responses",
    "rho_neg_mean": "num_neg_tokens",
    "rho_neg_kept_mean": "num_neg_kept_tokens",
    "log_rho_neg_mean": "num_neg_tokens",
    "rho_neg_below_half_frac": "num_neg_tokens",
    "rho_mean": "num_tokens",
    "abs_log_ratio_mean": "num_tokens",
    "entropy_mean": "num_entropy_tokens",
}


METRIC_COUNTS: tuple[str, ...] = ("num_tokens", "num_kept_tokens", "num_neg_tokens",
                                   "num_neg_kept_tokens", "num_neg_responses",
                                   "num_entropy_tokens")
"""The token and response counts of ``policy_loss``'s metrics, which the means are weighted by."""


def metric_sums(parts: list[dict[str, torch.Tensor]],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 ``[len(METRIC_COUNTS) + len(METRIC_WEIGHTS) + 1]``: each count, each mean times its
    weight, and the loss (when the parts carry one), summed over ``parts``. Sums of several ranks
    add up (an all-reduce SUM) to the sums of all their parts. Computed where the parts are
    (``device`` when there are none), without reading any value back to the host: on a GPU the
    learner reads the update's sums once, not ~15 values per microbatch."""
    names = (*METRIC_COUNTS, *METRIC_WEIGHTS, "loss")
    if parts:
        device = parts[0]["num_tokens"].device
    out = torch.zeros(len(names), dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.float64, device=device)  # a part without a metric
    for p in parts:  # in order, so the sums are the same numbers whatever the device
        out = out + torch.stack([p[c].double() if c in p else zero for c in METRIC_COUNTS]
                                + [p[n].double() * p[w].double() if n in p else zero
                                   for n, w in METRIC_WEIGHTS.items()]
                                + [p["loss"].double() if "loss" in p else zero])
    return out


def metrics_from_sums(sums: torch.Tensor | list[float], abs_log_ratio_max: float
                      ) -> dict[str, float]:
    """The metrics of the union of the parts summed in ``sums`` (see ``metric_sums``; a tensor, or
    its values already read), and the summed loss: every microbatch's loss is already divided by
    the minibatch's token count. A mean over nothing (its count is 0: no A < 0 token, no token
    kept, no entropy computed) is left out, not given as 0."""
    sums = sums.tolist() if isinstance(sums, torch.Tensor) else list(sums)
    out = dict(zip(METRIC_COUNTS, sums))
    for j, (name, weight) in enumerate(METRIC_WEIGHTS.items()):
        den = out[weight]
        if den:
            out[name] = sums[len(METRIC_COUNTS) + j] / den
    out["loss"] = sums[-1]
    out["abs_log_ratio_max"] = abs_log_ratio_max
    return out


def combine_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Combine ``policy_loss`` metrics of several microbatches as if computed on their union (in
    one process; the learner all-reduces ``metric_sums`` across ranks between the two steps)."""
    if not parts:
        return {}
    return metrics_from_sums(metric_sums(parts),
                             max(float(p["abs_log_ratio_max"]) for p in parts))

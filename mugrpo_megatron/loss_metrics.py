"""The metrics of the Mu-GRPO loss (``objective.policy_loss``): per call, each a mean with the
count it was taken over (``loss_metrics``), and how the calls of several microbatches and ranks
combine into the update's (``metric_sums``, ``metrics_from_sums``, ``combine_metrics``), and the
effective sample size the automatic upper clip reads (``ess_fractions``). Pure torch."""

from __future__ import annotations

import torch

from mugrpo_megatron import chunked


def loss_metrics(log_ratio_bt, rho_bt, adv_b1, response_bt, keep_bt, surr_bt, surr_clipped_bt,
                 dual_bt, clip_low: float, split, *, pg_loss, kl_bt=None, kl_loss=None,
                 entropy=None, entropy_loss=None, ess_grid=None) -> dict[str, torch.Tensor]:
    """``policy_loss``'s metrics (its docstring), each a mean with the count it was taken over."""
    # A token is clipped when the clipped branch is strictly smaller: its gradient is zero
    # (one the dual clip floors counts as dual-clipped, not here).
    clipped_bt = keep_bt & (surr_clipped_bt < surr_bt)
    if dual_bt is not None:
        clipped_bt = clipped_bt & ~dual_bt
    clipped_low_bt = clipped_bt & (rho_bt < 1.0 - clip_low)
    neg_bt = response_bt & (adv_b1 < 0)
    neg_kept_bt = keep_bt & (adv_b1 < 0)
    num_local, num_kept = response_bt.sum(), keep_bt.sum()
    num_neg, num_neg_kept = neg_bt.sum(), neg_kept_bt.sum()
    neg_b, vetoed_b = neg_bt.any(dim=1), (neg_bt & ~keep_bt).any(dim=1)
    if split is not None:  # whole responses: over the split, counted on its first rank
        both = chunked.row_any(torch.stack([neg_b, vetoed_b]), split)
        neg_b, vetoed_b = both & (split.cp_rank == 0)
    num_neg_responses = neg_b.sum()
    metrics = {
        "clip_frac": _safe_div(clipped_bt.sum(), num_kept),
        "clip_frac_low": _safe_div(clipped_low_bt.sum(), num_kept),
        "clip_frac_high": _safe_div((clipped_bt & ~clipped_low_bt).sum(), num_kept),
        "clip_frac_dual": _safe_div((keep_bt & dual_bt).sum(), num_kept)
        if dual_bt is not None else num_kept.new_zeros((), dtype=torch.float64),
        "veto_frac": _safe_div(num_local - num_kept, num_local),
        "veto_response_frac": _safe_div(vetoed_b.sum(), num_neg_responses),
        "rho_neg_mean": _safe_div((rho_bt * neg_bt).sum(), num_neg),
        "rho_neg_kept_mean": _safe_div((rho_bt * neg_kept_bt).sum(), num_neg_kept),
        "log_rho_neg_mean": _safe_div((log_ratio_bt * neg_bt).sum(), num_neg),
        "rho_neg_below_half_frac": _safe_div((neg_bt & (rho_bt < 0.5)).sum(), num_neg),
        "rho_mean": _safe_div((rho_bt * response_bt).sum(), num_local),
        "abs_log_ratio_mean": _safe_div(log_ratio_bt.abs().sum(), num_local),
        "abs_log_ratio_max": log_ratio_bt.abs().max() if log_ratio_bt.numel()
        else log_ratio_bt.new_zeros(()),
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
    return metrics


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

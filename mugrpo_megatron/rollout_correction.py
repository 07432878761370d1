"""Rollout correction: truncated (TIS) and masked (MIS) importance sampling between the engine
that sampled a phase and the learner that trains on it.

With ``algo.behaviour_logprobs: learner`` the ratios divide by the learner's log-probs of the
weights the engine sampled from (pi_old), not by the engine's own (pi_rollout). The two differ:
bf16 kernels, another attention implementation, an FP8 engine, MoE routing that flips. The
samples came from pi_rollout, so the loss needs pi_old / pi_rollout on top (verl's "decoupled"
mode; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; Liu, Li et al. 2025, "When speed kills stability"). Per model token t of a response,

    log w_t = clamp(log pi_old(t) - log pi_rollout(t), -20, 20)

(the clamp keeps exp() finite: verl's safety bound), and

- ``rollout_is`` (TIS): each kept token's clipped surrogate is multiplied by a weight:
  'token': min(exp(log w_t), C); 'sequence': min(exp(clamp(sum_t log w_t)), C) on every token
  of the response; C = ``rollout_is_threshold``. The weight is a constant of the phase (no
  gradient); the KL and entropy terms are not weighted (as verl weights only its pg_losses).
- ``rollout_rs`` (MIS, rejection): 'token': a token whose w_t is outside [L, U] leaves the
  loss; 'sequence': a response whose exp(sum log w) is outside [L, U] leaves it whole;
  'geometric': a response whose exp(mean log w) (the geometric mean of its w_t) is outside
  [L, U] leaves it whole. U = ``rollout_rs_threshold``, L = ``rollout_rs_threshold_lower``
  (1 / U when unset). What leaves the loss leaves its counts too, as a tool message's tokens
  do: the token-mean's denominator, a response's token count, the veto's scope.

Both are functions of the phase's data alone (neither log-prob moves during the phase), so
they are computed where a batch is read (``PhaseData.batch``) from whole rows: the same under
any data-, context- or pipeline-parallel split, packed or padded. With ``behaviour_logprobs:
engine`` (verl's bypass mode, the paper's) the ratio is pi_theta / pi_rollout already: the
relaxed clip and the veto bound it, and there is nothing to correct; the options are refused
there.

Names: verl's ``algorithm.rollout_correction`` has the same five keys (``rollout_is``,
``rollout_is_threshold``, ``rollout_rs``, ``rollout_rs_threshold``,
``rollout_rs_threshold_lower``); NeMo-RL's ``loss_fn.use_importance_sampling_correction`` with
``truncated_importance_sampling_ratio`` is token TIS, its ICE-POP and seq-mask-tis token and
sequence MIS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mugrpo_megatron.config.algo import IS_LEVELS, RS_LEVELS  # noqa: F401 - re-exported

LOG_BOUND = 20.0
"""|log w| is clamped to this before exp() (exp(20) ~ 4.9e8)."""


@dataclass(frozen=True)
class Correction:
    """A run's rollout correction (``algo.rollout_is`` and ``algo.rollout_rs``)."""

    is_level: str | None = None
    is_threshold: float = 2.0
    rs_level: str | None = None
    rs_upper: float = 2.0
    rs_lower: float = 0.5

    @classmethod
    def of(cls, algo) -> Correction | None:
        """The correction ``algo`` asks for; None where it asks for none."""
        if algo.rollout_is is None and algo.rollout_rs is None:
            return None
        upper = algo.rollout_rs_threshold
        lower = algo.rollout_rs_threshold_lower
        return cls(algo.rollout_is, algo.rollout_is_threshold, algo.rollout_rs, upper,
                   1.0 / upper if lower is None else lower)


def log_weights(old_bt: torch.Tensor, rollout_bt: torch.Tensor, mask_bt: torch.Tensor
                ) -> torch.Tensor:
    """clamp(log pi_old - log pi_rollout, +-LOG_BOUND) at the tokens of ``mask_bt``, 0 elsewhere."""
    diff = (old_bt.double() - rollout_bt.double()).clamp(-LOG_BOUND, LOG_BOUND)
    return torch.where(mask_bt, diff, torch.zeros_like(diff))


def correct(old_bt: torch.Tensor, rollout_bt: torch.Tensor, mask_bt: torch.Tensor,
            c: Correction) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The module's formulas over whole rows: each token's importance weight ([B, S] float32,
    1 outside ``mask_bt``; None without ``rollout_is``) and the tokens the loss keeps
    (``mask_bt`` less what ``rollout_rs`` rejects)."""
    log_w = log_weights(old_bt, rollout_bt, mask_bt)
    mask_bt = mask_bt.bool()
    n_b1 = mask_bt.sum(dim=1, keepdim=True)
    seq_b1 = log_w.sum(dim=1, keepdim=True).clamp(-LOG_BOUND, LOG_BOUND)
    weight = None
    if c.is_level is not None:
        per = log_w if c.is_level == "token" else seq_b1.expand_as(log_w)
        weight = torch.where(mask_bt, per.exp().clamp(max=c.is_threshold),
                             torch.ones_like(per)).float()
    keep = mask_bt
    if c.rs_level is not None:
        lo, hi = math.log(c.rs_lower), math.log(c.rs_upper)
        if c.rs_level == "token":
            keep = mask_bt & (log_w >= lo) & (log_w <= hi)
        else:
            level = seq_b1 if c.rs_level == "sequence" else \
                log_w.sum(dim=1, keepdim=True) / n_b1.clamp(min=1)
            keep = mask_bt & (level >= lo) & (level <= hi)
    return weight, keep


@dataclass
class CorrectionStats:
    """A phase's rollout correction in numbers, summed over its batches (``add``). Six numbers
    a phase, whatever its size."""

    tokens: int = 0
    responses: int = 0
    weight_sum: float = 0.0
    truncated: int = 0
    rejected_tokens: int = 0
    rejected_responses: int = 0

    def add(self, mask_bt: torch.Tensor, weight: torch.Tensor | None, keep: torch.Tensor,
            c: Correction) -> None:
        mask_bt = mask_bt.bool()
        has = mask_bt.any(dim=1)
        self.tokens += int(mask_bt.sum())
        self.responses += int(has.sum())
        if weight is not None:
            self.weight_sum += float(weight[mask_bt].double().sum())
            self.truncated += int((weight[mask_bt] >= c.is_threshold).sum())
        self.rejected_tokens += int((mask_bt & ~keep).sum())
        self.rejected_responses += int((has & ~keep.any(dim=1)).sum())

    def record(self) -> dict[str, float]:
        """The phase record's fields: the mean weight and the share truncated (TIS), the
        shares of tokens and of whole responses rejected (MIS)."""
        t, r = max(self.tokens, 1), max(self.responses, 1)
        return {"rollout_is_weight_mean": self.weight_sum / t,
                "rollout_is_truncated_frac": self.truncated / t,
                "rollout_rs_token_frac": self.rejected_tokens / t,
                "rollout_rs_response_frac": self.rejected_responses / r}

"""Mu-GRPO's schedule, clipping and veto, and the GRPO family's knobs around them (loss
aggregation, Dr.GRPO's advantages, KL, entropy, DAPO's overlong handling and refill). Each knob
names its counterpart in verl, slime or NeMo-RL."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from mugrpo_megatron.config.section import Section

# The values of the objective's knobs. Here, not beside the code that reads them
# (``objective``, ``rollout_correction``: torch), so that importing the config costs no torch: a
# reward worker process imports it (1.7 s of CPU and ~300 MB a worker when it took torch too).
VETO_SCOPES: tuple[str, ...] = ("none", "trigger", "suffix", "suffix_no_trigger", "sequence", "prefix")
"""``algo.veto_scope``'s values."""
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm")
"""How token losses become the minibatch's loss (verl's ``loss_agg_mode`` names)."""
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
"""Schulman's estimators of KL(pi_theta || pi_ref) from the sampled token's log-probs: verl's
``kl`` / ``mse`` / ``low_var_kl``."""
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""``algo.rollout_is``'s values (null: off)."""
RS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
"""``algo.rollout_rs``'s values (null: off)."""


@dataclass(frozen=True)
class AlgoConfig(Section):
    _name: ClassVar[str] = "algo"

    total_updates: int = 4096
    """Optimizer updates in the whole run (the paper uses 4096 for both GRPO and Mu-GRPO)."""
    updates_per_phase: int = 1024
    """mu: optimizer updates per rollout refresh. 4 is standard GRPO; 1024 is Mu-GRPO's 4 phases.
    With max_drift, the most updates a phase runs."""
    prompts_per_phase: int = 1024
    """Prompts whose G responses are generated at the start of each phase (for mu updates; with
    max_drift a phase after the first generates for the updates the recent phases ran)."""
    max_drift: float | None = None
    """A drift-bounded schedule: end a phase, and start the next with a fresh generation, once
    the policy has drifted this far from the phase's behaviour policy, measured as the mean
    |log rho| over the response tokens of the last drift_window updates (each update's
    abs_log_ratio_mean, taken in its forward pass before it steps, so every rank has it: no
    collective is added). A phase runs at least min_phase_updates and at most mu updates; the
    run's total_updates stay, so the number of phases and weight syncs is an outcome. Each
    phase's record says how many updates it ran ('updates') and why it ended ('end': mu or
    drift). The bound must stand well above the train/inference gap (update 0's |log rho|:
    ~1e-6 in fp32, 1e-3 to 1e-2 in bf16). null: every phase runs mu updates. See README,
    'Choosing the schedule'."""
    drift_window: int = 4
    """Updates whose mean |log rho| the max_drift bound is compared with (smooths one update's
    noise)."""
    min_phase_updates: int = 4
    """With max_drift, the fewest updates a phase runs (no phase is a generation for nothing)."""
    samples_per_update: int = 256
    """Responses in one optimizer update (the minibatch), over all data-parallel ranks."""
    clip_low: float = 1.0
    """eps_low: the ratio is clipped below at 1 - clip_low (1.0 = no lower clip, as in [0, 5])."""
    clip_high: float | str = 4.0
    """eps_high: the ratio is clipped above at 1 + clip_high (4.0 = the paper's relaxed [0, 5]).
    'auto': set before every update from the one before (``phase.AutoClip``, the paper's open
    question 2): the largest of clip_high_auto_grid under which the previous update's ratios of
    the positive-advantage tokens, capped there, keep an effective sample size of at least
    clip_high_auto_ess of their number; the largest at a phase's first update (every ratio is 1
    there). Logged every update as clip_high, with the ESS at each candidate (ess_clip_*)."""
    clip_high_auto_grid: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 3.0, 4.0)
    """With clip_high: auto, the eps_high values it chooses from, increasing (0.2: PPO's; 4.0:
    the paper's relaxed clip); at most 8. The smallest where none keeps the ESS."""
    clip_high_auto_ess: float = 0.5
    """With clip_high: auto, the effective sample size, as a share of the tokens, the capped ratios
    must keep: (sum w)^2 / (n sum w^2) >= this, w = min(rho, 1 + eps_high). 0.5 is importance
    sampling's usual resampling threshold (Kong 1992; Liu 2001): below it the weighted estimate's
    variance is over twice an on-policy one's."""
    clip_ratio_c: float | None = None
    """Dual clip (Ye et al. 2019; verl actor.clip_ratio_c, which verl's vanilla loss always
    applies at 3.0): a token with A < 0 contributes at most clip_ratio_c * |A| to the loss, its
    gradient zero past that. null: off, as in the paper's formula (a wide [0, 5] clip leaves an
    A < 0 token's rho * A unbounded above 5). Must be > 1."""
    log_ratio_clamp: float | None = None
    """Clamp log pi_theta - log pi_behav to +-this before the ratio of the loss is taken (verl
    clamps at 20, always); its gradient is zero past it. The metrics and the veto see the ratio
    as it is. null: off. Needed beside clip_ratio_c where ratios can overflow: exp of a
    log-ratio above ~88 is infinite in fp32, and the update is skipped."""
    veto_threshold: float | None = 1e-4
    """Negative-advantage veto: a token of an A < 0 response whose ratio falls below this triggers
    it. null disables the veto."""
    veto_scope: Literal["none", "trigger", "suffix", "suffix_no_trigger", "sequence",
                        "prefix"] = "suffix"
    """Tokens removed once a veto triggers: 'suffix' is the paper's S_kappa (after the first
    trigger). 'prefix': a trust region on the prefix instead of a single-token trigger: in an
    A < 0 response, the tokens after the first position where the running sum of log rho falls
    below -veto_prefix_bound leave the loss (veto_threshold then only turns the veto on)."""
    veto_prefix_bound: float = 9.21
    """B of veto_scope 'prefix': the prefix's ratio pi_theta / pi_behav may fall to exp(-B)
    before the rest of the response leaves the loss; 9.21 = -log(1e-4), the single-token
    threshold's bound applied to the whole prefix."""
    adv_eps: float = 1e-6
    """eps in A = (r - mean) / (std + eps)."""
    uniform_groups: Literal["keep", "drop", "drop_once", "refill"] = "keep"
    """Groups whose G responses all got the same reward (A = 0 on every token). 'keep': trained
    on like any sample, each once a pass; they add nothing to the gradient but count in the token
    mean, which shrinks the step by their share (GRPO in TRL and verl). 'drop': left out, and the
    mu updates of samples_per_update draw from the rest, so each remaining sample is trained on
    1 / (1 - uniform fraction) times as often: staler than the paper's. 'drop_once': left out,
    and each update takes the rest / mu (a multiple of DP x micro_batch_size): one pass, smaller
    and noisier updates, nothing reused. 'refill' (DAPO's dynamic sampling; verl
    algorithm.filter_groups, slime --over-sampling-batch-size with a dynamic-sampling filter):
    left out, and the phase generates from further prompts until it holds as many informative
    groups as prompts it was planned for, within max_refill_rounds (each engine replica refills
    its own share as its scores come in: no barrier between replicas). Uniform groups are
    counted and logged either way, with the passes each phase made."""
    max_refill_rounds: int = 4
    """With uniform_groups: refill, the most rounds of further prompts a replica generates in a
    phase, each sized by its deficit of informative groups at the rate it saw; at most this many
    times the phase's planned prompts are generated beyond them (verl's
    filter_groups.max_num_gen_batches). A phase still short after them trains on what it has, as
    'drop' would, and its record says so."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses make an update's loss (verl actor.loss_agg_mode, same names; NeMo-RL
    loss_fn.token_level_loss is token-mean or seq-mean-token-mean; slime
    --calculate-per-token-loss is token-mean): 'token-mean' (DAPO's) divides the sum by the
    minibatch's response tokens; 'seq-mean-token-mean' (GRPO's paper) averages each response's
    mean; 'seq-mean-token-sum' averages each response's sum; 'seq-mean-token-sum-norm'
    (Dr.GRPO's) averages each response's sum divided by loss_agg_norm. Every count is the whole
    minibatch's (one all-reduce of two integers over the data-parallel group, the one that
    carried the token count before), so each mode is its one-big-batch value at any DP size,
    microbatching and packing. KL and entropy terms are aggregated the same way."""
    loss_agg_norm: float | None = None
    """The constant of seq-mean-token-sum-norm (verl actor.loss_scale_factor); null: the longest
    response, rollout.max_new_tokens (Dr.GRPO's choice)."""
    norm_adv_by_std: bool = True
    """Divide a response's advantage by its group's reward std (GRPO); false gives Dr.GRPO's
    r - group mean (verl algorithm.norm_adv_by_std_in_grpo; slime
    --disable-grpo-std-normalization inverts it; NeMo-RL grpo.normalize_rewards)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty in the loss (verl actor.use_kl_loss with actor.kl_loss_coef; slime
    --use-kl-loss --kl-loss-coef; NeMo-RL loss_fn.reference_policy_kl_penalty). 0: off, and then
    no reference is kept and no pass computed. See kl_target."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimate (verl actor.kl_loss_type: 'kl', 'mse', 'low_var_kl'; slime
    --kl-loss-type): k1 = log(pi / pi_ref), k2 = (log(pi / pi_ref))^2 / 2, k3 = pi_ref / pi -
    log(pi_ref / pi) - 1 with the log-ratio clamped to +-20 and the estimate to [-10, 10], as
    verl and TRL clamp it (past a clamp a token's term passes no gradient)."""
    kl_target: Literal["reference", "behaviour"] = "reference"
    """What the KL is to. 'reference': the policy the run started from (model.path, or
    checkpoint.load_from), as verl and slime: each rank keeps its shard of the reference weights
    in pinned host memory (at the 70B config 4.4 GB a rank, 35 GB a node), and once a phase, after
    generation, swaps them into the model's weights for one no-grad pass over the phase's tokens
    (rollouts/phase_N/reference_logprobs.arrow; about a third of a training pass over them: the
    dry run gives its seconds and memory); the learner's own weights wait in host memory,
    offloaded for the generation anyway. 'behaviour': the phase's frozen behaviour policy, from
    the log-probs already stored for every token (no weights, no pass): a soft trust region
    against the drift within a Mu-GRPO phase, which no peer has."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus, subtracted from the loss with its gradient (verl
    actor.entropy_coeff; slime --entropy-coef), through the vocabulary-parallel entropy the
    learner computes anyway (its forward's two all-reduces over the TP group run for every
    microbatch; its backward needs no collective). 0: entropy is only logged. Costs one fp32
    copy of a microbatch's logits (the dry run's logits item)."""
    overlong_filter: bool = False
    """Responses cut at rollout.max_new_tokens leave the loss: no update draws them (NeMo-RL
    grpo.overlong_filtering; DAPO's overlong filtering). Their group statistics stay as
    generated, with every response's reward: the baseline of the others is the one they were
    sampled against, and dropping the truncated ones from it would bias it toward short
    responses. Counted in each phase record (overlong_filtered)."""
    overlong_buffer_tokens: int = 0
    """DAPO's soft overlong punishment (verl reward_model.overlong_buffer.len): a response longer
    than rollout.max_new_tokens minus this many tokens has its reward lowered linearly, to
    -overlong_penalty at the limit, before advantages (the phase log keeps the task reward
    apart). 0: off."""
    overlong_penalty: float = 1.0
    """The punishment at the length limit (verl reward_model.overlong_buffer.penalty_factor)."""
    behaviour_logprobs: Literal["engine", "learner"] = "engine"
    """The behaviour policy's log-probs the ratios divide by. 'engine': the engine's, as it
    sampled (the paper's bypass; no extra pass). 'learner': the learner scores every response of
    a phase once, before its first update, with the weights the engine sampled from, and keeps
    them beside the engine's (rollouts/phase_N/behaviour_learner.arrow): one forward pass over
    the phase's tokens, about a third of a training pass over them. On GPUs in bf16, or with an
    FP8 engine, the two differ by 1e-3 or more a token, which moves ratios near the veto's
    trigger; the phase log has that gap over every token, and the seconds the pass took."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Truncated importance sampling (TIS) from the engine's sampling to the learner's behaviour
    policy, with behaviour_logprobs: learner (verl algorithm.rollout_correction.rollout_is):
    each kept token's clipped surrogate times min(pi_old / pi_rollout, rollout_is_threshold),
    that ratio per token ('token') or its product over the response ('sequence'). A constant
    of the phase. null: off. See ``rollout_correction`` and README, 'The objective'."""
    rollout_is_threshold: float = 2.0
    """TIS's truncation C (verl rollout_is_threshold; its typical 1.5-5 a token, 2-10 a
    sequence)."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Masked importance sampling (MIS: rejection), with behaviour_logprobs: learner (verl
    rollout_rs): a token ('token'), or a whole response ('sequence': the product of its
    pi_old / pi_rollout; 'geometric': their geometric mean), whose ratio is outside
    [rollout_rs_threshold_lower, rollout_rs_threshold] leaves the loss and its counts.
    null: off."""
    rollout_rs_threshold: float = 2.0
    """MIS's upper bound U (verl rollout_rs_threshold; 'geometric' wants ~1.0002-1.001)."""
    rollout_rs_threshold_lower: float | None = None
    """MIS's lower bound (verl rollout_rs_threshold_lower); null: 1 / rollout_rs_threshold."""
    seed: int = 1234
    """Seed for prompt order, minibatch shuffling and the learner's initialisation."""

    @property
    def clip_high_auto(self) -> bool:
        """Whether the upper clip is set every update (``clip_high: auto``)."""
        return self.clip_high == "auto"

    def _check_clip_high(self) -> None:
        if isinstance(self.clip_high, str) and self.clip_high != "auto":
            try:
                float(self.clip_high)
            except ValueError:
                self._fail("clip_high", "must be a number or 'auto'")
            self._fail("clip_high", "must be a finite number")
        if not self.clip_high_auto:
            self._non_negative("clip_high")
        grid = self.clip_high_auto_grid
        if not 1 <= len(grid) <= 8 or any(b <= a for a, b in zip(grid, grid[1:])) \
                or grid[0] <= 0:
            self._fail("clip_high_auto_grid", "must be 1 to 8 increasing values > 0")
        if not 0 < self.clip_high_auto_ess <= 1:
            self._fail("clip_high_auto_ess", "must be in (0, 1]")

    def _check_rollout_correction(self) -> None:
        for key, levels in (("rollout_is", IS_LEVELS), ("rollout_rs", RS_LEVELS)):
            if getattr(self, key) is not None and getattr(self, key) not in levels:
                self._fail(key, f"must be one of {list(levels)} or null")
            if getattr(self, key) is not None and self.behaviour_logprobs != "learner":
                self._fail(key, "corrects the engine's sampling toward the learner's behaviour "
                                "log-probs, and needs algo.behaviour_logprobs: learner; with "
                                "'engine' the ratios divide by the engine's log-probs already "
                                "(verl's bypass mode): the clip and the veto bound them")
        self._positive("rollout_is_threshold", "rollout_rs_threshold")
        lower = self.rollout_rs_threshold_lower
        if lower is not None and not 0 < lower < self.rollout_rs_threshold:
            self._fail("rollout_rs_threshold_lower", f"must be in (0, algo.rollout_rs_threshold"
                                                     f" = {self.rollout_rs_threshold:g}) or null")

    def __post_init__(self) -> None:
        self._positive("total_updates", "updates_per_phase", "prompts_per_phase",
                       "samples_per_update", "adv_eps")
        if self.total_updates % self.updates_per_phase:
            self._fail("total_updates", f"must be a multiple of algo.updates_per_phase "
                                        f"({self.updates_per_phase})")
        if not 0 <= self.clip_low <= 1:
            self._fail("clip_low", "must be in [0, 1] (the lower ratio bound 1 - clip_low >= 0)")
        self._check_clip_high()
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            self._fail("clip_ratio_c", "must be > 1 (the dual clip bounds an A < 0 token's loss "
                                       "at clip_ratio_c * |A|, above the clip's own) or null")
        if self.log_ratio_clamp is not None and not self.log_ratio_clamp > 0:
            self._fail("log_ratio_clamp", "must be > 0 or null")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            self._fail("veto_threshold", "must be in (0, 1) or null")
        if self.veto_scope not in VETO_SCOPES:  # the Literal above, for direct construction too
            self._fail("veto_scope", f"must be one of {list(VETO_SCOPES)}")
        self._positive("veto_prefix_bound", "drift_window", "min_phase_updates")
        self._non_negative("kl_coef", "entropy_coef", "overlong_buffer_tokens", "overlong_penalty",
                           "max_refill_rounds")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            self._fail("loss_agg", f"must be one of {list(LOSS_AGGREGATIONS)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            self._fail("kl_estimator", f"must be one of {list(KL_ESTIMATORS)}")
        if self.loss_agg_norm is not None:
            self._positive("loss_agg_norm")
        self._check_rollout_correction()
        if self.max_drift is not None:
            self._positive("max_drift")
            if self.min_phase_updates > self.updates_per_phase:
                self._fail("min_phase_updates", f"must be at most algo.updates_per_phase "
                                                f"({self.updates_per_phase})")

    @property
    def num_phases(self) -> int:
        """Phases of mu updates: the schedule's phases without max_drift, the fewest with it."""
        return self.total_updates // self.updates_per_phase

    @property
    def max_phases(self) -> int:
        """The most phases (and weight syncs) the run can make: with max_drift, each of them as
        short as min_phase_updates allows."""
        if self.max_drift is None:
            return self.num_phases
        return math.ceil(self.total_updates / self.min_phase_updates)

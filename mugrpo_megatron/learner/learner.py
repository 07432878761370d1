"""The Megatron-core learner: per-token log-probs and Mu-GRPO optimizer updates in any TP/PP/DP layout.

An update's minibatch is split over the data-parallel ranks in contiguous shares (``dp_rows``).
``train_step`` takes either the whole minibatch on every rank or, as the trainer gives it, only
this rank's share (``dp_local``: what it read from the phase's shards, so no rank reads or pads
the rows of the others; at DP 8 and 10^6 response tokens an update, 1/8 of ~12 MB of tokens and
log-probs instead of all of it). The pipeline schedule runs the rank's microbatches, and results
are summed over ranks so every rank sees the same numbers. ``logprobs`` (checks, evaluation)
takes a whole batch and returns it whole on every rank.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from mugrpo_megatron.learner.compat_megatron import megatron_on_cpu

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    finalize_model_grads,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from mugrpo_megatron import distributed
from mugrpo_megatron.config import Config, ModelConfig, OptimConfig, ParallelConfig
from mugrpo_megatron.layout import context_comm_type, pack_capacity, packs_with, round_up, token_multiple
from mugrpo_megatron.learner.context import packed_split_for, split_for, thd_params
from mugrpo_megatron.learner.fp8 import forward_amaxes_kept
from mugrpo_megatron.learner.hf_weights import load_hf_weights
from mugrpo_megatron.learner.logits import policy_logits, vocab_parallel_entropy
from mugrpo_megatron.learner.microbatch import (
    MicroBatch,
    build_microbatches,
    next_aligned,
    per_sequence,
    right_padded,
    split_columns,
    split_packed_columns,
)
from mugrpo_megatron.learner.model import (
    DTYPES,
    build_chunks,
    ddp_config,
    init_parallel,
    lr_schedule,
    optimizer_config,
    uses_transformer_engine,
)
from mugrpo_megatron.learner.offload import HostOffload, OffloadStats, ReferenceWeights
from mugrpo_megatron.loss_metrics import metric_sums, metrics_from_sums
from mugrpo_megatron.models.hf_config import read_model_spec
from mugrpo_megatron.objective import policy_loss
from mugrpo_megatron.types import TokenBatch, TrainBatch

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(log-probs, behaviour log-probs, advantages, loss mask, num_tokens=, num_sequences=,
entropy=, ref_logp=) -> (loss, metrics): the objective a train step minimises
(``objective.policy_loss`` with a run's clip, veto, aggregation, KL and entropy terms)."""


@dataclass
class StepResult:
    """The outcome of one optimizer update, identical on every rank."""

    loss: float
    """The minibatch's policy loss (NaN or inf when the step was skipped for it)."""
    grad_norm: float
    """Global gradient norm before clipping (NaN when skipped before it was computed)."""
    lr: float
    """Learning rate used."""
    skipped: bool
    """True when the update was not applied: parameters and optimizer state are untouched."""
    reason: str = ""
    """Why the update was skipped."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The objective's metrics over the whole minibatch (see objective.policy_loss)."""
    seconds: float = 0.0
    """Wall time of the update."""


class Learner:
    """megatron-core GPTModel chunks with DDP, the (distributed) optimizer and an LR schedule."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, optim: OptimConfig, *,
                 loss: LossFn, temperature: float, seed: int, total_updates: int,
                 max_sequence_tokens: int, hf_dir: str | Path | None = None,
                 kl_target: str | None = None, entropy_grad: bool = False):
        """The learner of ``model`` (its weights from ``hf_dir``, default ``model.path``) in the
        ``parallel`` layout, trained by ``optim`` for ``total_updates`` updates on ``loss``
        (``objective.policy_loss`` with the run's clip and veto); ``temperature`` is the
        sampling temperature the engine's log-probs are taken at; ``max_sequence_tokens`` (the
        longest prompt + response) sizes packed rows (``parallel.pack_tokens: auto``).
        ``kl_target`` ('reference', 'behaviour' or None: no KL term) says which log-probs the
        loss's KL term is taken against: a batch's ``ref_logp`` or its behaviour log-probs;
        ``entropy_grad``: the loss has an entropy bonus, so the entropy is computed with its
        gradient."""
        self.model_cfg, self.parallel, self.optim = model, parallel, optim
        self.hf_dir = Path(hf_dir or model.path)
        self.spec = read_model_spec(self.hf_dir)
        self.layout = init_parallel(parallel, seed)
        chunks = build_chunks(self.spec, model, parallel)
        load_hf_weights(chunks, self.spec, self.hf_dir, self.layout.tp_rank, self.layout.tp_size)
        self.config = chunks[0].config  # the TransformerConfig every chunk was built with
        self.config.finalize_model_grads_func = finalize_model_grads
        with megatron_on_cpu():
            if DTYPES[model.dtype] != torch.float32:
                chunks = [Float16Module(self.config, c) for c in chunks]
            ddp = ddp_config(parallel)  # one, shared by the chunks (virtual pipeline stages)
            self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp, module=c)
                          for c in chunks]
            self.optimizer = get_megatron_optimizer(optimizer_config(optim, model, parallel),
                                                    self.model)
        self.scheduler = lr_schedule(self.optimizer, optim, total_updates)
        self.loss = loss
        self.kl_target = kl_target
        self.entropy_grad = entropy_grad
        self.num_updates = 0
        self._host = HostOffload(self.model, self.optimizer)
        self.reference: ReferenceWeights | None = None
        """The reference policy's weights (``keep_reference``), for a KL term to it."""
        # The engine samples from softmax(logits / T) and reports those log-probs
        # (processed_logprobs), so the learner's policy is the same tempered distribution.
        self.temperature = temperature
        # packed rows: THD layout (cu_seqlens) through TE's attention, a block-diagonal causal
        # mask through megatron's local attention (whose sliding window would replace the mask)
        self.uses_thd = uses_transformer_engine(model)
        self.token_multiple = token_multiple(model, parallel)
        """Microbatch rows (and packed rows) are padded to a multiple of this (``fp8``)."""
        self.pack_capacity = pack_capacity(
            parallel, max_sequence_tokens, self.uses_thd, self.token_multiple,
            exchange_packs=packs_with(context_comm_type(self.spec, parallel)))
        """Tokens of a packed microbatch row; 0 pads instead (``parallel.pack_tokens``)."""
        self._fp8_delayed = model.fp8_format is not None and model.fp8_recipe == "delayed"
        self._fp8_uncalibrated = self._fp8_delayed
        """Delayed scaling sets FP8 scales from the amax history only in grad-enabled passes
        (TE's ``autocast_exit``, and the backward): until one has run, a no-grad pass would
        quantize with the initial scale of 1.0 (``_calibrate_fp8``)."""
        if self.pack_capacity and not self.uses_thd and self.spec.sliding_window:
            raise ValueError("parallel.pack_tokens: a sliding-window model packs only with "
                             "Transformer Engine (THD); set parallel.pack_tokens: 0")

    @classmethod
    def from_config(cls, cfg: Config, hf_dir: str | Path | None = None) -> Learner:
        """The learner a run of ``cfg`` trains: its sections, and the clipped, vetoed policy
        loss of ``cfg.algo``."""
        a = cfg.algo
        auto = a.clip_high_auto  # the trainer passes each update's clip (phase.AutoClip)
        loss = partial(policy_loss, clip_low=a.clip_low,
                       clip_high=a.clip_high_auto_grid[-1] if auto else a.clip_high,
                       ess_grid=a.clip_high_auto_grid if auto else None,
                       clip_ratio_c=a.clip_ratio_c, log_ratio_clamp=a.log_ratio_clamp,
                       veto_threshold=a.veto_threshold, veto_scope=a.veto_scope,
                       veto_prefix_bound=a.veto_prefix_bound, loss_agg=a.loss_agg,
                       loss_agg_norm=cfg.loss_agg_norm, kl_coef=a.kl_coef,
                       kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef)
        return cls(cfg.model, cfg.parallel, cfg.optim, loss=loss,
                   temperature=cfg.rollout.temperature, seed=a.seed,
                   total_updates=a.total_updates, max_sequence_tokens=cfg.max_sequence_tokens,
                   hf_dir=hf_dir, kl_target=a.kl_target if a.kl_coef else None,
                   entropy_grad=a.entropy_coef > 0)

    # ------------------------------------------------------------------ batches

    def _fit_sequence(self, batch: TokenBatch) -> TokenBatch:
        """Right-pad the rows to a multiple of ``token_multiple``: with sequence parallel each TP
        rank holds an equal slice of the sequence, and FP8 GEMMs take only token counts that
        are multiples of 16 and more (``fp8``). The padding is no response token, so no loss or
        log-prob sees it."""
        seq = batch.tokens.shape[1]
        if seq % self.token_multiple == 0:
            return batch
        return right_padded(batch, round_up(seq, self.token_multiple))

    def _dp_local_tokens(self, batch: TrainBatch, count: torch.Tensor
                         ) -> tuple[TrainBatch, torch.Tensor]:
        """For this rank's share of a minibatch and its ``count`` of response tokens and
        responses: the whole minibatch's counts, summed over the data-parallel group (one
        all-reduce of two integers, whatever ``algo.loss_agg`` needs of them), and the batch
        padded to the group's longest where expert parallelism needs it (its token dispatch
        gathers equal-sized activations from the ranks of the expert-parallel group, which span
        DP ranks; packed rows are equal already). A few integers cross the group: nothing at any
        scale."""
        if self.layout.dp_size == 1:
            return batch, count
        group = mpu.get_data_parallel_group()
        dist.all_reduce(count, group=group)  # stays on the device: the loss divides by it there
        if self.parallel.expert > 1 and not self.pack_capacity:
            seq = torch.tensor(batch.tokens.shape[1], device=distributed.device())
            dist.all_reduce(seq, op=dist.ReduceOp.MAX, group=group)
            batch = right_padded(batch, int(seq))  # a read, with expert parallelism only
        return batch, count

    def dp_rows(self, num_rows: int) -> slice:
        """The rows of a ``num_rows``-row minibatch that this data-parallel rank trains on: a
        contiguous share, the same on the ranks of one tensor/pipeline-parallel group."""
        dp = self.layout.dp_size
        if num_rows % dp:
            raise ValueError(f"batch of {num_rows} sequences does not split over {dp} "
                             f"data-parallel ranks")
        per_rank = num_rows // dp
        return slice(self.layout.dp_rank * per_rank, (self.layout.dp_rank + 1) * per_rank)

    def _microbatches(self, batch: TokenBatch, train: bool, dp_local: bool = False,
                      capacity: int | None = None) -> list[MicroBatch]:
        """This rank's rows of ``batch`` (all of them with ``dp_local``) as microbatches, packed
        into rows of ``capacity`` tokens (default ``pack_capacity``; 0: padded), as many as
        every other rank of its data-parallel group runs (``_equal_count``)."""
        with_ref = train and self.kl_target == "reference"
        if with_ref and batch.ref_logp is None:
            raise ValueError("algo.kl_target: reference needs the batch's reference log-probs")
        mine = slice(0, batch.size) if dp_local else self.dp_rows(batch.size)
        cp = self.layout.cp_size
        out = build_microbatches(
            batch, mine, micro_batch_size=self.parallel.micro_batch_size,
            capacity=self.pack_capacity if capacity is None else capacity, train=train,
            with_ref=with_ref, equal_count=self._equal_count, align=2 * cp if cp > 1 else 1)
        if cp == 1:
            return out
        # context parallel: this rank's chunks of each row, or of each packed sequence
        return [split_packed_columns(mb, packed_split_for(mb.packed)) if mb.packed is not None
                else split_columns(mb, split_for(batch.tokens.shape[1])) for mb in out]

    def _equal_count(self, count: int) -> int:
        """The most microbatches any rank of this data-parallel group packed (``count`` here):
        each runs that many, the short ones with empty rows. Per-microbatch collectives over
        groups that span data-parallel ranks need every member to run as many microbatches:
        Transformer Engine's FP8 amax reduction (delayed scaling, over megatron's amax group, TP
        x DP (x CP) unless ``tp_only_amax_red``: after every grad-enabled forward, in
        ``fp8_autocast``'s exit, and in every backward; TE 2.0-2.20, megatron-core
        ``fp8_utils.get_fp8_context``), each MoE layer's token dispatch over the expert-parallel
        group, and context parallelism. DP ranks pack their own rows, so their bin counts differ
        (at the 70B shape, in 174 of 200 simulated updates, by up to 8): without this a rank
        that finished enters the gradient reduce-scatter while another waits in an amax
        all-reduce, until the timeout. One integer all-reduce over the DP group (within each
        pipeline stage) a call; padded microbatches are equal in number by construction (every
        rank holds as many rows), so only packing calls this."""
        if self.layout.dp_size == 1:
            return count
        n = torch.tensor(count, device=distributed.device())
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())
        return int(n)

    def _run(self, microbatches: list[MicroBatch], loss_fn, forward_only: bool) -> list[dict]:
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            device = distributed.device()
            extra = {"attention_mask": None}
            if mb.packed is not None and (self.uses_thd or mb.split is not None):
                # THD (under CP also on CPU: megatron's THD RoPE, our CP attention)
                extra["packed_seq_params"] = thd_params(
                    mb.packed if mb.split is None else mb.split.whole, device)
            elif mb.packed is not None:
                extra["attention_mask"] = mb.packed.attention_mask(device)
            output = model(input_ids=mb.tokens.to(device), position_ids=mb.position_ids.to(device),
                           **extra)
            return output, partial(loss_fn, mb)

        n_chunks = len(self.model)
        iterators = [iter(microbatches) for _ in range(n_chunks)]
        # the whole row's length: megatron's pipeline shapes divide it by the CP size
        seq = microbatches[0].tokens.shape[1] * self.layout.cp_size
        with megatron_on_cpu():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if n_chunks > 1 else iterators[0],
                model=self.model if n_chunks > 1 else self.model[0],
                num_microbatches=len(microbatches), seq_length=seq,
                micro_batch_size=microbatches[0].tokens.shape[0], forward_only=forward_only)

    # ------------------------------------------------------------------ log-probs

    def token_logprobs(self, logits_bsv: torch.Tensor, labels_bs: torch.Tensor,
                       with_entropy: bool = False, entropy_grad: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs ``[b, s]`` of this TP rank's output, and with ``with_entropy``
        the policy's entropy at each position (``learner.logits``), with its gradient when
        ``entropy_grad`` (an entropy bonus in the loss)."""
        logits = policy_logits(logits_bsv, self.temperature, self.spec.vocab_size,
                               self.layout.tp_rank)
        entropy = vocab_parallel_entropy(logits, grad=entropy_grad) if with_entropy else None
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels_bs), entropy

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, with_entropy: bool = False, *, packed: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-prob of every token given its prefix, ``[B, S]`` aligned with ``batch.tokens``
        (0 at position 0), on every rank; with ``with_entropy``, the entropy of the distribution
        each token was drawn from. ``packed=False`` pads even where the learner packs (the
        check of the packed path against the padded one)."""
        seq = batch.tokens.shape[1]
        batch = self._fit_sequence(batch)
        microbatches = self._microbatches(batch, train=False, capacity=None if packed else 0)

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            logp, entropy = self.token_logprobs(output, mb.labels.to(output.device), with_entropy)
            # kept on the device: the rows are gathered and read back once (``_gather_rows``)
            out = {"logp": per_sequence(mb, logp), "rows": mb.rows,
                   "positions": None if mb.split is None else mb.split.positions}
            if with_entropy:
                out["entropy"] = per_sequence(mb, entropy)
            return output.new_zeros(()), out

        for m in self.model:
            m.eval()
        if self._fp8_uncalibrated:
            self._calibrate_fp8(microbatches[:1])
        with forward_amaxes_kept(self._fp8_delayed):  # the next update scales as without it
            results = self._run(microbatches, loss_fn, forward_only=True)
        for m in self.model:
            m.train()
        logp = self._gather_rows(results, "logp", batch)[:, :seq].contiguous()
        ent = None
        if with_entropy:
            ent = self._gather_rows(results, "entropy", batch)[:, :seq].contiguous()
        return logp, ent

    def _calibrate_fp8(self, microbatches: list[MicroBatch]) -> None:
        """FP8 with delayed scaling, before a run's first update: one grad-enabled forward pass
        of this rank's first microbatch, its output dropped (no backward, no update). Leaving
        ``fp8_autocast`` with grad on, Transformer Engine reduces the amax over megatron's amax
        group and sets every forward scale from it (TE 2.0-2.20 ``FP8GlobalStateManager.
        autocast_exit``), so the no-grad passes that come before the first update (the mismatch
        and packing checks, ``behaviour_logprobs: learner``'s scoring) quantize with calibrated
        scales instead of 1.0. Every rank runs exactly one such forward (each has a microbatch),
        so the amax all-reduce over TP x DP has all its members; recipes with current scaling
        need none."""
        with torch.enable_grad():
            self._run(microbatches, lambda mb, output: (output.new_zeros(()), {}),
                      forward_only=True)
        self._fp8_uncalibrated = False

    def _gather_rows(self, results: list[dict], key: str, batch: TokenBatch) -> torch.Tensor:
        """Next-aligned per-row results of the last stage -> token-aligned [B, S] on every rank,
        assembled on the device and read back to the host once. Device memory: 4 bytes a token
        of the batch for ``full``, beside the microbatches' results (as much again) until it
        returns; the callers score batches (a minibatch, the mismatch check's rows), never a
        phase at once."""
        full = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=distributed.device())
        if mpu.is_pipeline_last_stage(ignore_virtual=True) and self.layout.tp_rank == 0:
            for r in results:
                if isinstance(r["rows"], torch.Tensor) and not r["rows"].numel():
                    continue  # a filler microbatch (expert parallelism): no row of the batch
                pos = r.get("positions")
                if pos is not None:  # context parallel: this rank's columns
                    width = full.shape[1]  # packed: each sequence's own, past the row if none
                    nxt = full.new_zeros(full[r["rows"]].shape[0], width + 1)
                    pos = pos.to(nxt.device).expand(nxt.shape[0], -1).clamp(max=width)
                    nxt.scatter_(1, pos, r[key].float())
                    full[r["rows"], 1:] = nxt[:, :width - 1]
                    continue
                width = r[key].shape[1]
                full[r["rows"], 1:width] = r[key][:, :-1].float()
        dist.all_reduce(full)
        return full.cpu()

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, *, dp_local: bool = False,
                   clip_high: float | None = None) -> StepResult:
        """One optimizer update over a minibatch: ``batch`` is the whole of it, the same on every
        rank, or with ``dp_local`` only this data-parallel rank's rows of it (``dp_rows``), padded
        to their own longest. Both give the same update. ``clip_high``: this update's eps_high
        in place of the loss's own (``algo.clip_high: auto``)."""
        clip = {} if clip_high is None else {"clip_high": clip_high}
        t0 = time.perf_counter()
        # The global counts of response tokens (next-aligned, before the veto) and of responses:
        # every microbatch's loss is divided by what algo.loss_agg makes of them, so the update
        # does not depend on the layout or the split.
        mask = next_aligned(batch.response_mask.bool())
        counts = torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(distributed.device())
        if dp_local:
            batch, counts = self._dp_local_tokens(batch, counts)
        batch = self._fit_sequence(batch)
        microbatches = self._microbatches(batch, train=True, dp_local=dp_local)
        # megatron divides each microbatch loss by their number and DDP averages over DP ranks;
        # undo both so the gradient is that of the whole minibatch's loss. Under context
        # parallelism DDP averages over DP x CP, and megatron's schedule first multiplies a
        # loss of a two-output loss function by the CP size (``schedules.forward_step``, 0.16.1
        # and 0.19.2), so the CP ranks' losses, each its columns' share, add up as they should.
        scale = len(microbatches) * self.layout.dp_size

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            device = output.device
            logp, entropy = self.token_logprobs(output, mb.labels.to(device), with_entropy=True,
                                                entropy_grad=self.entropy_grad)
            behav = mb.behav_logp.to(device)
            ref = {"reference": mb.ref_logp, "behaviour": behav, None: None}[self.kl_target]
            loss, metrics = self.loss(
                per_sequence(mb, logp), behav, mb.advantages.to(device), mb.loss_mask.to(device),
                num_tokens=counts[0], num_sequences=counts[1], entropy=per_sequence(mb, entropy),
                ref_logp=ref.to(device) if ref is not None else None, split=mb.split,
                is_weight=mb.is_weight.to(device) if mb.is_weight is not None else None, **clip)
            metrics["loss"] = loss.detach().float()
            return loss * scale, metrics

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._run(microbatches, loss_fn, forward_only=False)
        self._fp8_uncalibrated = False  # the grad-enabled forward set the scales
        metrics, bad = self._step_summary(results)
        lr = self.optimizer.param_groups[0]["lr"]
        if bad:
            for m in self.model:
                m.zero_grad_buffer()
            return StepResult(loss=metrics["loss"], grad_norm=math.nan, lr=lr, skipped=True,
                              reason=bad, metrics=metrics, seconds=time.perf_counter() - t0)
        with megatron_on_cpu():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # fp16 loss-scaler overflow: megatron already skipped the update
            return StepResult(loss=metrics["loss"], grad_norm=math.nan, lr=lr, skipped=True,
                              reason="fp16 gradient overflow", metrics=metrics,
                              seconds=time.perf_counter() - t0)
        self.scheduler.step(increment=1)
        self.num_updates += 1
        return StepResult(loss=metrics["loss"], grad_norm=float(grad_norm or 0.0), lr=lr,
                          skipped=False, metrics=metrics, seconds=time.perf_counter() - t0)

    def _step_summary(self, results: list[dict]) -> tuple[dict[str, float], str]:
        """The update's metrics, combined over every microbatch and DP rank as if computed on the
        whole minibatch, and '' if its loss and every gradient are finite on every rank, else why
        not. ``loss_metrics.metric_sums`` on the ranks that computed the loss (the last pipeline
        stage, TP rank 0) and each rank's gradient check stay on the device; two all-reduces,
        then one read to the host: the update's only synchronisation of ours (megatron's
        gradient clipping reads the grad norm once more). Reading each value as it came was
        ~15 reads a microbatch and one a parameter: ~100 device syncs an update at 70B."""
        computed = mpu.is_pipeline_last_stage(ignore_virtual=True) and self.layout.tp_rank == 0
        device = distributed.device()
        sums = metric_sums(results if computed else [], device)
        peak = (torch.stack([r["abs_log_ratio_max"] for r in results]).max().double()
                if computed and results else torch.zeros((), dtype=torch.float64, device=device))
        grads = [p.main_grad for m in self.model for p in m.parameters()
                 if getattr(p, "main_grad", None) is not None]
        # one small kernel a parameter, no read (megatron's contiguous grad buffers would be
        # fewer, but they are internals)
        grads_bad = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).double() \
            if grads else torch.zeros((), dtype=torch.float64, device=device)
        maxes = torch.stack([peak, grads_bad])
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        host = torch.cat([sums, maxes]).cpu().tolist()  # the one read
        metrics = metrics_from_sums(host[:-2], host[-2])
        if not math.isfinite(metrics["loss"]):  # the whole minibatch's loss, on every rank
            return metrics, "non-finite loss"
        if host[-1] > 0:
            return metrics, "non-finite gradient"
        return metrics, ""

    # ------------------------------------------------------------------ memory

    def offload(self) -> OffloadStats:
        """Free the learner's accelerator memory: gradient buffers freed, optimizer state and
        weights copied to the host (``offload.HostOffload``)."""
        return self._host.offload()

    def onload(self) -> OffloadStats:
        """Bring the learner back, bit for bit, before the next update or weight sync."""
        return self._host.onload()

    def host_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """A weight's host copy, offloaded: what a sync streams (``HostOffload.host_tensor``)."""
        return self._host.host_tensor(param)

    @property
    def offloaded(self) -> bool:
        """Whether any of the learner's state is in host memory now (``offload``)."""
        return self._host.offloaded

    @property
    def on_device(self) -> str:
        """What of the learner is on its device: 'all' or 'nothing' (offloaded)."""
        return {"device": "all", "host": "nothing"}[self._host.state]

    @property
    def host_bytes(self) -> int:
        """Host memory the learner's offloads hold (pinned on CUDA), kept between phases."""
        return self._host.pool.nbytes

    def resident_bytes(self) -> int:
        """Bytes of weights, gradient buffers and optimizer state now on the learner's device."""
        return self._host.resident_bytes()

    # ------------------------------------------------------------------ the reference

    def keep_reference(self) -> None:
        """Keep the weights as they are now as the reference policy (``algo.kl_target:
        reference``): this rank's shards in host memory (``offload.ReferenceWeights``)."""
        self.reference = ReferenceWeights(self._host)

    @contextlib.contextmanager
    def reference_weights(self):
        """Context: the reference's weights in the model inside (for ``logprobs``, collective),
        the learner's own back in place after, bit for bit. A swap copies every weight both
        ways (4.4 GB a GPU at the 70B config): take it once for a whole pass over a phase."""
        if self.reference is None:
            raise RuntimeError("no reference policy was kept (keep_reference)")
        with self.reference.swapped_in():
            yield

    # ------------------------------------------------------------------ weights

    def chunks(self) -> list[torch.nn.Module]:
        """The bare GPTModel chunks (without DDP / Float16Module wrappers)."""
        out = []
        for m in self.model:
            inner = m.module
            out.append(inner.module if isinstance(inner, Float16Module) else inner)
        return out

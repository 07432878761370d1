"""The Mu-GRPO loop: for each phase, sync weights, generate, score, advantages once, then mu updates
(or, with ``algo.max_drift``, updates until the policy has drifted that far).

GRPO (mu = 4) and Mu-GRPO (mu = 1024) are configs of this one loop. Every rank runs the learner
and drives the rollout engines collectively (``engines.fleet``: a tensor-parallel rank of a
replica on every rank, or one engine on global rank 0). Each replica streams its share of a
phase and its leader scores and writes it as shards (``phase.generation``); every rank then opens
the phase's files and reads only its data-parallel share of each update's rows
(``phase.store.PhaseData``): no rank holds a whole phase and none is sent one.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from mugrpo_megatron import distributed, run_dir
from mugrpo_megatron.config import Config
from mugrpo_megatron.config.loader import to_dict
from mugrpo_megatron.data import load_eval_sets
from mugrpo_megatron.data.prompt_store import discard_staging, open_prompt_set
from mugrpo_megatron.distributed import on_rank0
from mugrpo_megatron.engines.fleet import EngineFailed, EngineFleet
from mugrpo_megatron.evaluation import eval_record, reported_k, score_eval, set_sampling, write_samples
from mugrpo_megatron.handoff import Handoff, sync_engine_tp
from mugrpo_megatron.inputs import load_tokenizer, prepare_data
from mugrpo_megatron.learner.checkpoint import load_learner, prune, save_learner, usable_checkpoint
from mugrpo_megatron.learner.export import iter_hf_tensors, save_hf_checkpoint
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.metrics import MetricsLogger
from mugrpo_megatron.outputs import DiskFull, RunFailed
from mugrpo_megatron.phase import (
    Advantages,
    AutoClip,
    DriftBound,
    GenerationFailed,
    Phase,
    PhaseData,
    PhaseEnd,
    PhaseRecord,
    PhaseScheduler,
    Refill,
    ScheduleState,
    check_packing,
    generate_phase,
    is_generated,
    mismatch_gap,
    phase_dir,
    record_plan,
    score_behaviour,
    score_reference,
)
from mugrpo_megatron.phase.schedule import mixture_coverage
from mugrpo_megatron.progress import Progress
from mugrpo_megatron.rewards import RewardScorer
from mugrpo_megatron.rewards.scorer import RewardFailed
from mugrpo_megatron.rollout_correction import Correction
from mugrpo_megatron.trajectory import ToolSetup, tool_rows


class Trainer:
    def __init__(self, cfg: Config, start: str = "new"):
        """Build the learner (process groups included), data, engine and reward workers.

        The layout must already have been checked (``layout.check_layout``) and the run
        directory for this start (``run_dir.check``, which returns ``start``)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.rank0 = dist.get_rank() == 0
        self.tokenizer = load_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.progress = Progress(enabled=self.rank0 and cfg.logging.progress)
        # the data before megatron's groups, model and engines: held-out sets on every rank; the
        # prompts rank 0 tokenized (``inputs.prepare_data``), read by all as phases need them
        self.eval_sets = {name: prompts for name, (prompts, _) in
                          load_eval_sets(cfg.data, self.tokenizer).items()}
        self.prompts = open_prompt_set(
            cfg, self.run_dir, self.tokenizer, note=self.progress.note, bar=self.progress.bar,
            other_sources=sorted({p.source for ps in self.eval_sets.values() for p in ps}))
        report = self.prompts.report
        # no rank looks into the run directory before it is this run's (a barrier)
        on_rank0(run_dir.record_start, cfg, dist.get_world_size())
        self.log = MetricsLogger(cfg.logging, self.run_dir, self.rank0, to_dict(cfg))
        self.learner = Learner.from_config(cfg)
        self.schedule = PhaseScheduler(cfg.algo, cfg.rollout.group_size, len(self.prompts),
                                       file_sizes=self.prompts.file_sizes,
                                       weights=cfg.data.weights)
        off = cfg.parallel.offload_learner
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.handoff = Handoff(self.learner, off == "always" or (off == "auto" and
                                                                 torch.cuda.is_available()),
                               cfg.rollout.weight_bucket_mb << 20, self.log, self.rank0,
                               self.ckpt_dir, sync_engine_tp(cfg.rollout, self.learner))
        if self.rank0:
            held = ", ".join(f"{n} {len(ps)}" for n, ps in self.eval_sets.items()) or "none"
            self.progress.note(f"data: {report.summary()}; held out: {held}")
        ckpt = None
        if cfg.checkpoint.resume and start == "resume":  # rank 0 checks; every rank loads its pick
            ckpt = on_rank0(usable_checkpoint, self.ckpt_dir, self._warn)
        if cfg.checkpoint.load_from and (ckpt is None or self.keeps_reference):
            load_learner(self.learner, Path(cfg.checkpoint.load_from))
        if self.keeps_reference:  # the policy the run started from, before any resume
            self.learner.keep_reference()
        # the engine sizes its memory from what is free when it starts: the learner steps aside
        with self.handoff.learner_offloaded():
            # no weights read from disk: the first sync (before any generation) writes them all
            self.engines = self.handoff.engines = EngineFleet.start(
                cfg.rollout, cfg.model.path, dtype=cfg.model.dtype,
                max_model_len=cfg.engine_max_len,
                trust_remote_code=cfg.model.trust_remote_code, load_weights=False,
                timeout_minutes=cfg.parallel.timeout_minutes,
                tools=ToolSetup.of(cfg, self.tokenizer))
            self.handoff.mark_memory("start")
            self.engines.sleep()  # awake only to generate (and take weights), not while training
        # NCCL's watchdog reports a timeout in its own words ("Timeout(ms)=..."): say which
        # setting that is (gloo's timeouts are named by the train command itself)
        self.progress.note(f"rollout: {self.engines.describe()}; every collective times out "
                           f"after parallel.timeout_minutes = {cfg.parallel.timeout_minutes:g}")
        # a reward pool beside each replica's leader (rank 0's also scores the held-out sets)
        self.scorer = RewardScorer(cfg.reward) if self.engines.is_leader else None
        self._packing_checked = False
        self.start_update = 0
        self.state = ScheduleState(ended=[], drift_window=[])
        """The phases that ended and the running phase's drift window (``save`` keeps it)."""
        if ckpt is not None:
            counters = load_learner(self.learner, ckpt)
            self.start_update = counters["update"]
            self.state = ScheduleState.from_counters(counters, cfg.algo)
            self.progress.note(f"resumed from {ckpt} at update {self.start_update}")
        if self.rank0:
            self._warn_coverage()

    @property
    def keeps_reference(self) -> bool:
        """Whether the run keeps a reference policy (a KL term to the one it started from)."""
        a = self.cfg.algo
        return bool(a.kl_coef) and a.kl_target == "reference"

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        if self.start_update == 0:
            self.evaluate("before")
        # phases are planned one at a time: with algo.max_drift, each from how the last ended
        while (phase := self.schedule.plan(self.state.ended)) is not None:
            self.run_phase(phase)
        self.evaluate("after")
        if self.cfg.checkpoint.export_hf:
            out = self.run_dir / "hf"
            save_hf_checkpoint(iter_hf_tensors(self.learner.chunks(), self.learner.spec,
                                               dtype=getattr(torch, self.cfg.model.dtype)),
                               out, self.cfg.model.path, write=self.rank0, dtype=self.cfg.model.dtype)
            self.progress.note(f"final policy exported as a Hugging Face checkpoint: {out}")
        if self.rank0:
            from mugrpo_megatron.report import write_report

            path = write_report(self.run_dir)
            self.progress.note(f"report: {path}")
            run_dir.mark_finished(self.cfg, self.learner.num_updates)

    def run_phase(self, phase: Phase) -> None:
        """Generate (unless on disk), score the reference policy (a KL term to it) and the
        behaviour policy (``behaviour_logprobs: learner``), check, optimize until the phase
        ends; its record in the phase log."""
        t0 = time.perf_counter()
        rec = PhaseRecord(phase.index, phase.first_update, phase.planned_updates,
                          uniform_policy=self.cfg.algo.uniform_groups)
        data = self.rollout(phase, rec)
        try:
            self.reference(data, rec)  # a resumed phase's, when an earlier start had not
            if self.cfg.algo.behaviour_logprobs == "learner":
                self.behaviour_from_learner(phase, data, rec)
            t_check = time.perf_counter()
            self.check(data, rec)
            rec.check_seconds = time.perf_counter() - t_check
            self.optimize(phase, data, rec)
        finally:
            data.close()
        rec.wall_seconds = time.perf_counter() - t0 - (rec.eval_seconds or 0.0)
        self._log_phase(rec, data)

    def rollout(self, phase: Phase, rec: PhaseRecord) -> PhaseData:
        """The phase's scored samples with advantages, opened from disk on every rank; generated
        first unless an earlier start finished generating this phase, and then the reference
        policy scores them while the learner is still offloaded."""
        directory = phase_dir(self.run_dir, phase.index)
        if on_rank0(self._plan_on_disk, directory, phase):
            return self._open(directory)
        with self.handoff.learner_offloaded(rec):  # the engine's weights woken alone for a sync
            rec.sync_seconds = self.handoff.sync_weights()
            rec.switch_seconds += self.engines.wake()  # the KV cache: the learner stepped aside
            self.generate(phase, directory, rec)
            self.handoff.mark_memory("generate", phase.index)
            rec.switch_seconds += self.engines.sleep()
            data = self._open(directory)
            self.reference(data, rec)  # the device is free: the engine asleep, the learner out
        return data

    def _open(self, directory: Path) -> PhaseData:
        layout, a = self.learner.layout, self.cfg.algo
        return PhaseData(directory, drop_uniform=a.uniform_groups != "keep",
                         overlong_filter=a.overlong_filter, pad_id=self.pad_id,
                         dp_rank=layout.dp_rank, dp_size=layout.dp_size,
                         micro_batch_size=self.cfg.parallel.micro_batch_size,
                         tools=bool(self.cfg.rollout.tools))

    def reference(self, data: PhaseData, rec: PhaseRecord) -> None:
        """``algo.kl_target: reference``: the reference policy's log-probs of every response
        token of the phase, once (a phase is fixed, so one pass a phase, not one an update):
        its weights swapped into the learner's for a no-grad pass, rank 0 writing the log-probs
        beside the shards, found there by a resume. Then the phase's batches carry them."""
        if not self.keeps_reference:
            return
        if not on_rank0(data.has_reference_logprobs):
            t0, swaps = time.perf_counter(), self.learner.reference.swaps
            rec.set_gap("reference_gap", score_reference(
                self.learner, data, self.cfg.algo.samples_per_update, write=self.rank0))
            rec.reference_seconds = time.perf_counter() - t0
            rec.reference_swaps = self.learner.reference.swaps - swaps
            self.handoff.mark_memory("reference", rec.phase)
        data.use_reference_logprobs()

    @staticmethod
    def _plan_on_disk(directory: Path, phase: Phase) -> bool:
        """Rank 0: the phase's plan kept (or checked against the one an earlier start kept);
        whether the phase is generated already."""
        record_plan(directory, phase)
        return is_generated(directory)

    def behaviour_from_learner(self, phase: Phase, data: PhaseData, rec: PhaseRecord) -> None:
        """``algo.behaviour_logprobs: learner``: the learner scores every response of the phase
        before its first update (its weights are still the ones the engine sampled from); rank 0
        writes the log-probs beside the shards, and the phase's ratios divide by them. A resume
        finds them there (``phase.checks.score_behaviour``)."""
        correction = Correction.of(self.cfg.algo)
        if not on_rank0(data.has_learner_logprobs):
            if self.start_update > phase.first_update:
                raise RunFailed(f"phase {phase.index}: the learner's behaviour log-probs are "
                                f"missing in {data.directory}, and the learner has trained past "
                                f"the phase's start, so they cannot be computed again")
            t0 = time.perf_counter()
            gap, rec.rollout_correction = score_behaviour(
                self.learner, data, self.cfg.algo.samples_per_update, self.rank0, correction)
            rec.set_gap("behaviour_gap", gap)
            rec.behaviour_seconds = time.perf_counter() - t0
        data.use_learner_logprobs(correction)

    def check(self, data: PhaseData, rec: PhaseRecord) -> None:
        """A few of the engine's own samples scored by the learner: the train/inference gap
        (rows spread over the phase, so every replica's copy of the weights is checked); and,
        where the learner packs (``parallel.pack_tokens``), once a run, the packed path against
        the padded one (``phase.checks.check_packing``)."""
        rec.set_gap("logprob_gap", mismatch_gap(self.learner, data,
                                                self.cfg.rollout.mismatch_check_samples))
        if self.learner.pack_capacity and not self._packing_checked:
            self._packing_checked = True
            rec.set_gap("pack_check_gap", check_packing(self.learner, data, self.cfg))

    def generate(self, phase: Phase, directory: Path, rec: PhaseRecord) -> None:
        """Every replica streams its share of the groups not yet on disk, its leader scores and
        writes shards as groups finish, and rank 0 indexes the phase (``generate_phase``)."""
        t0 = time.perf_counter()
        try:
            a = self.cfg.algo
            refill = Refill(a.max_refill_rounds) if a.uniform_groups == "refill" else None
            counts = generate_phase(self.engines, directory, phase, self.cfg.rollout,
                                    self.prompts, self.scorer, self.tokenizer, self.progress,
                                    Advantages.of(self.cfg), refill,
                                    partial(self.schedule.prompt_index, phase))
        except GenerationFailed as e:
            raise RunFailed(f"phase {phase.index}: generation failed ({e}). Kept: every shard "
                            f"written in {directory}; resume by running again.") from None
        counts.record(rec, time.perf_counter() - t0)
        if counts.reward_failures:
            self._warn(f"reward, phase {phase.index}: {counts.describe_failures()}")

    def optimize(self, phase: Phase, data: PhaseData, rec: PhaseRecord) -> None:
        """The phase's updates, from where a resume left off, until it has run its mu updates or
        the drift bound ends it (``algo.max_drift``); checkpoints; per-update metrics."""
        if self.learner.offloaded:  # after a sync alone (a resumed phase, no held-out set)
            rec.switch_seconds += self.learner.onload().seconds
        drift = DriftBound(self.cfg.algo, self.state.drift_window)  # a resume's, or empty
        clip = AutoClip(self.cfg.algo, self.state.clip_high) if self.cfg.algo.clip_high_auto \
            else None
        first = max(self.start_update, phase.first_update)
        updates = data.updates(self.schedule, phase, first,
                               once=self.cfg.algo.uniform_groups == "drop_once")
        bar = self.progress.bar(f"phase {phase.index} optimize",
                                total=phase.first_update + phase.max_updates - first)
        done, stop, t_eval, t_data, t_save = first - phase.first_update, False, 0.0, 0.0, 0.0
        t_opt = time.perf_counter()
        while not stop:
            t0 = time.perf_counter()
            upd = next(updates, None)  # this rank's share of the update's rows, from the shards
            t_data += time.perf_counter() - t0
            if upd is None:
                break
            mb, done = upd.minibatch, upd.minibatch.step_in_phase + 1
            if upd.batch is None:
                rec.skipped_updates += 1
                self._log_update(mb.update, {"skipped": True, "reason": "too few samples"})
                bar.update(1)
                continue
            step = self.learner.train_step(upd.batch, dp_local=True,
                                           clip_high=clip.clip if clip else None)
            if clip and not step.skipped:
                clip.observe(step.metrics)
                self.state.clip_high = clip.clip
            rec.skipped_updates += step.skipped
            self._log_step(phase, mb, upd.rows, data, step)
            bar.update(1, loss=step.loss, veto=step.metrics.get("veto_frac", 0.0))
            value = step.metrics.get("abs_log_ratio_mean")
            stop = not step.skipped and value is not None and drift.observe(mb.step_in_phase, value)
            self.state.drift_window = drift.window
            if self.cfg.checkpoint.on_interval(mb.update + 1) and done < phase.max_updates \
                    and not stop:  # a phase's end saves below
                t_save += self.save(mb.update + 1, phase.index)
            t_eval += self.evaluate_every(mb.update + 1)
        bar.close()
        self.handoff.mark_memory("optimize", phase.index)
        rec.optimize_seconds = time.perf_counter() - t_opt - t_eval - t_save  # the held-out
        # curve and the checkpoints are not training
        rec.batch_read_seconds = t_data
        rec.eval_seconds = t_eval or None
        rec.updates, rec.end = done, "drift" if stop and done < phase.max_updates else "mu"
        rec.drift = drift.drift if self.cfg.algo.max_drift is not None else None
        rec.passes, rec.unused_frac = data.passes, data.unused_frac
        rec.unused_generate_seconds = rec.generate_seconds * data.unused_frac
        self.state.ended.append(PhaseEnd(phase.index, phase.first_update, done, rec.end,
                                         data.positions_used))
        self.state.drift_window, self.state.clip_high = [], None
        end = phase.first_update + done
        if (self.cfg.checkpoint.save_at_phase_end or end >= self.cfg.algo.total_updates
                or self.cfg.checkpoint.on_interval(end)):
            t_save += self.save(end, phase.index)
        rec.save_seconds = t_save

    def save(self, update: int, phase: int) -> float:
        """A checkpoint at ``update`` with the schedule's state (the phases that ended, the
        running phase's drift window): a resume from it plans and ends phases as this start
        does. Returns the seconds it took."""
        t0 = time.perf_counter()
        save_learner(self.learner, self.ckpt_dir / f"update_{update:07d}",
                     {"update": update, "phase": phase, "schedule": self.state.to_json()})
        self.handoff.mark_memory("save", phase)
        if self.rank0:
            prune(self.ckpt_dir, self.cfg.checkpoint.keep_last)
        self.start_update = update
        return time.perf_counter() - t0

    def evaluate(self, label: str, since: float | None = None) -> None:
        """Every held-out set (``data.eval_path``), each sampled as ``eval.*`` says, the
        learner offloaded; rank 0 scores them and logs one 'eval' record: each set's pass@k and
        mean@k (by source within a set that has several), the seconds it took (from ``since``:
        with the sync made for it), and the first set's numbers under the keys of runs before
        named sets."""
        if not self.eval_sets:
            return
        t0 = time.perf_counter() if since is None else since
        specs = {name: set_sampling(self.cfg, name) for name in self.eval_sets}
        with self.handoff.learner_offloaded():
            self.handoff.sync_weights()
            self.engines.wake()
            gens = {name: self.engines.generate([p.token_ids for p in prompts], specs[name],
                                                rows=[tool_rows(p) for p in prompts])
                    for name, prompts in self.eval_sets.items()}
            self.handoff.mark_memory("evaluate")
            self.engines.sleep()  # before the learner comes back to the device
        # rank 0 scores; a failure there (reward.on_error: raise) stops every rank
        results = on_rank0(lambda: {name: score_eval(gens[name], prompts, self.scorer,
                                                     self.tokenizer,
                                                     reported_k(self.cfg, specs[name].n),
                                                     tools=bool(self.cfg.rollout.tools))
                                    for name, prompts in self.eval_sets.items()})
        if not self.rank0:
            return
        self.log.log("eval", self.learner.num_updates,
                     eval_record(results, label, time.perf_counter() - t0))
        keep = self.cfg.logging.eval_samples
        if keep == "all" or (keep == "ends" and label in ("before", "after")):
            write_samples(self.run_dir / "eval" / f"{self.learner.num_updates:07d}_"
                                                  f"{label.replace(' ', '_')}", results)
        for name, r in results.items():
            self.progress.note(f"held-out {name} ({label}): {r.summary()}")
            if r.num_failed:
                self._warn(f"reward, held-out {name} ({label}): {r.describe_failures()}")

    def evaluate_every(self, update: int) -> float:
        """The held-out curve (``logging.eval_every_updates``): after ``update`` when it is a
        multiple, except the run's last, which ``evaluate('after')`` scores. ``evaluate`` leaves
        the engine asleep, as the optimizer expects it. Returns the seconds it took (0 when it
        skips)."""
        every = self.cfg.logging.eval_every_updates
        if not every or update % every or update >= self.cfg.algo.total_updates:
            return 0.0
        t0 = time.perf_counter()
        self.evaluate(f"update {update}", since=t0)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        self.engines.shutdown()
        self.prompts.close()
        self.log.close()

    # ---------------------------------------------------------------- helpers

    def _warn(self, message: str) -> None:
        """Something the user must see whatever logging.progress says (rank 0): on stderr, and as
        an event in metrics.jsonl."""
        if self.rank0:
            print(f"warning: {message}", file=sys.stderr, flush=True)
            self.log.log("event", self.start_update, {"warning": message})

    def _warn_coverage(self) -> None:
        """Rank 0: a run too short for ``data.weights`` (``mixture_coverage``), and the sources
        of the prompt set that none of the run's draws reaches (a run of at most a mixture
        block: ``PhaseScheduler.unseen_sources``), with the reward routes that never run."""
        unseen = self.schedule.unseen_sources(
            lambda indices: [self.prompts[i].source for i in indices], self.prompts.sources)
        text = mixture_coverage(self.cfg)
        if unseen:
            routes = [s for s in unseen if s in self.cfg.reward.by_source]
            text += ("; " if text else "") + (
                f"no prompt the run draws has source {', '.join(unseen)} (of "
                f"{', '.join(self.prompts.sources)}): never trained on"
                + (f", and reward.by_source.{', reward.by_source.'.join(routes)} never runs"
                   if routes else ""))
        if text:
            self._warn(text)

    def _log_update(self, update: int, values: dict) -> None:
        self.log.log("update", update, values)

    def _log_step(self, phase: Phase, mb, rows, data: PhaseData, step) -> None:
        """An update's record: its place in the phase, the learner's numbers, the data's."""
        n_tok = int(data.response_len[rows].sum())
        self._log_update(mb.update, {
            "phase": phase.index, "staleness": mb.step_in_phase, "epoch": mb.epoch,
            "samples": len(rows), "loss": step.loss, "grad_norm": step.grad_norm, "lr": step.lr,
            "skipped": step.skipped, "reason": step.reason, "seconds": step.seconds,
            "tokens_per_s": n_tok / step.seconds if step.seconds else 0.0,
            "response_len": n_tok / len(rows), "reward": float(data.reward[rows].mean()),
            **data.trajectory_stats(rows),
            **{k: v for k, v in step.metrics.items() if not k.startswith("num_")}})
        if step.skipped:
            self.progress.note(f"update {mb.update} skipped ({step.reason}); parameters and "
                               f"optimizer state untouched, nothing else lost")

    def _log_phase(self, rec: PhaseRecord, data: PhaseData) -> None:
        if not self.rank0:
            return
        stats = data.stats()
        values = {**rec.values(), **stats, "engine_replicas": self.engines.num_replicas}
        self.log.log("phase", rec.first_update + rec.updates, values)
        gap = (f", train/infer gap {rec.logprob_gap_mean:.2e} (max {rec.logprob_gap_max:.2e})"
               if rec.logprob_gap_mean is not None else "")
        failed = rec.reward_errors + rec.reward_timeouts
        failures = (f", reward failures {failed} (" + ", ".join(
            f"{k} {v}" for k, v in sorted((rec.reward_failures_by_source or {}).items())) + ")"
                    if failed else "")
        self.progress.note(
            f"phase {rec.phase}: {rec.updates} updates (ended: {rec.end}), reward "
            f"{stats['reward_mean']:.3f}{failures}{data.describe_tools(stats)}, "
            f"{stats['uniform_groups']} uniform groups, "
            f"generate {rec.generate_seconds:.1f}s, sync {rec.sync_seconds:.2f}s, optimize "
            f"{rec.optimize_seconds:.1f}s{gap}")


def train(cfg: Config, start: str) -> int:
    """The ``train`` command, once the layout and the run directory (``run_dir.check``, which
    gave ``start``) are checked on every rank: the default group, the ranks' agreement on the
    run directory before any model, engine or data, then the run. Returns the exit status; a
    failure the user can act on is printed, not raised."""
    made: list[Path] = []
    if int(os.environ.get("RANK", "0")) == 0:  # before any process group (``inputs``)
        try:
            made = prepare_data(cfg, start)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
    distributed.init_default_group(cfg.parallel.timeout_minutes)
    try:
        start = run_dir.agree(cfg, start)
    except ValueError:
        if dist.get_rank() == 0:  # the ranks see different directories: leave none of ours
            discard_staging(Path(cfg.logging.run_dir), made)
        raise
    if start == "replace":  # --overwrite, now that every rank sees the directory it replaces
        on_rank0(run_dir.replace_run, cfg)
    trainer = None
    try:
        trainer = Trainer(cfg, start)
        trainer.run()
    except (RunFailed, DiskFull, distributed.RemoteFailure, EngineFailed, RewardFailed) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        if not distributed.is_collective_timeout(e):
            raise
        # said before the clean-up, which may itself wait on the rank that stopped answering
        print(f"error: {distributed.timeout_explanation(cfg.parallel.timeout_minutes)}\n"
              f"({type(e).__name__}: {str(e)[:500]})", file=sys.stderr, flush=True)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    distributed.leave()
    return 0

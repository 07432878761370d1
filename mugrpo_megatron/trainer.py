"""The Mu-GRPO loop: for each phase, sync weights, generate, score, advantages once, then mu updates.

GRPO (mu = 4) and Mu-GRPO (mu = 1024) are configs of this one loop. Every rank runs the learner
and drives the rollout engines collectively (``engines.fleet``: a tensor-parallel rank of a
replica on every rank, or one engine on global rank 0). Each replica streams its share of a
phase and its leader scores and writes it as shards (``phase.generation``); every rank then opens
the phase's files and reads only its data-parallel share of each update's rows
(``phase.store.PhaseData``): no rank holds a whole phase and none is sent one.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mugrpo_megatron import distributed, run_dir
from mugrpo_megatron.config import Config
from mugrpo_megatron.config.loader import to_dict
from mugrpo_megatron.data import load_prompts
from mugrpo_megatron.data.prompt_store import open_prompt_set
from mugrpo_megatron.distributed import on_rank0
from mugrpo_megatron.engines.fleet import EngineFailed, EngineFleet
from mugrpo_megatron.evaluation import eval_sampling, score_eval
from mugrpo_megatron.learner.checkpoint import load_learner, prune, save_learner, usable_checkpoint
from mugrpo_megatron.learner.export import iter_hf_tensors, save_hf_checkpoint
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.metrics import MetricsLogger
from mugrpo_megatron.outputs import DiskFull, RunFailed
from mugrpo_megatron.phase.batches import LogprobGap
from mugrpo_megatron.phase.checks import check_packing, mismatch_gap, score_behaviour
from mugrpo_megatron.phase.generation import GenerationFailed, generate_phase
from mugrpo_megatron.phase.schedule import Phase, PhaseScheduler
from mugrpo_megatron.phase.store import PhaseData, is_generated, phase_dir
from mugrpo_megatron.progress import Progress
from mugrpo_megatron.rewards import RewardScorer


@dataclass
class PhaseTimes:
    sync: float = 0.0
    """Resharding the learner's weights into the engine."""
    switch: float = 0.0
    """Engine sleep/wake and learner offload/onload."""
    generate: float = 0.0
    score: float = 0.0
    optimize: float = 0.0
    extra: dict = field(default_factory=dict)


class Trainer:
    def __init__(self, cfg: Config, start: str = "new"):
        """Build the learner (process groups included), data, engine and reward workers.

        The layout must already have been checked (``layout.check_layout``) and the run
        directory for this start (``run_dir.check``, which returns ``start``)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.learner = Learner.from_config(cfg)
        self.rank0 = dist.get_rank() == 0
        # no rank looks into the run directory before it is this run's (a barrier)
        on_rank0(run_dir.record_start, cfg, start, dist.get_world_size())
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.log = MetricsLogger(cfg.logging, self.run_dir, self.rank0, to_dict(cfg))
        self.progress = Progress(enabled=self.rank0 and cfg.logging.progress)
        # tokenized once, by rank 0, into the run directory; every rank reads prompts from it as
        # a phase needs them (collective)
        self.prompts = open_prompt_set(cfg, self.run_dir, self.tokenizer,
                                       note=self.progress.note, bar=self.progress.bar)
        report = self.prompts.report
        self.eval_prompts, _ = load_prompts(cfg.data, self.tokenizer, held_out=True)
        self.schedule = PhaseScheduler(cfg.algo, cfg.rollout.group_size, len(self.prompts))
        off = cfg.parallel.offload_learner
        self.offload = off == "always" or (off == "auto" and torch.cuda.is_available())
        if self.rank0:
            self.progress.note(f"data: {report.summary()}; held out: {len(self.eval_prompts)}")
        # the engine sizes its memory from what is free when it starts: the learner steps aside
        with self.learner_offloaded():
            # no weights read from disk: the first sync (before any generation) writes them all
            self.engines = EngineFleet.start(
                cfg.rollout, cfg.model.path, dtype=cfg.model.dtype,
                max_model_len=cfg.max_sequence_tokens,
                trust_remote_code=cfg.model.trust_remote_code, load_weights=False,
                timeout_minutes=cfg.parallel.timeout_minutes)
            self.mark_memory("start")
            self.engines.sleep()  # awake only to generate (and take weights), not while training
        # NCCL's watchdog reports a timeout in its own words ("Timeout(ms)=..."): say which
        # setting that is (gloo's timeouts are named by the train command itself)
        self.progress.note(f"rollout: {self.engines.describe()}; every collective times out "
                           f"after parallel.timeout_minutes = {cfg.parallel.timeout_minutes:g}")
        # a reward pool beside each replica's leader (global rank 0 leads replica 0 and also
        # scores the held-out set)
        self.scorer = RewardScorer(cfg.reward) if self.engines.is_leader else None
        # the learner update whose weights the engine holds (None: the checkpoint it started from)
        self._engine_has: int | None = None
        self._packing_checked = False
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.start_update = 0
        ckpt = None
        if cfg.checkpoint.resume and start == "resume":  # rank 0 checks; every rank loads its pick
            ckpt = self._from_rank0(usable_checkpoint(self.ckpt_dir, self._warn)
                                    if self.rank0 else None)
        if ckpt is not None:
            counters = load_learner(self.learner, ckpt)
            self.start_update = counters["update"]
            self.progress.note(f"resumed from {ckpt} at update {self.start_update}")
        elif cfg.checkpoint.load_from:
            load_learner(self.learner, Path(cfg.checkpoint.load_from))

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        if self.start_update == 0:
            self.sync_weights()
            self.evaluate("before")
        for phase in self.schedule.phases():
            if phase.first_update + phase.num_updates <= self.start_update:
                continue  # finished before a restart
            times = PhaseTimes()
            data = self.rollout(phase, times)
            if self.cfg.algo.behaviour_logprobs == "learner":
                self.behaviour_from_learner(phase, data, times)
            self.optimize(phase, data, times)
            data.close()
        self.sync_weights()
        self.evaluate("after")
        if self.cfg.checkpoint.export_hf:
            out = self.run_dir / "hf"
            save_hf_checkpoint(iter_hf_tensors(self.learner.chunks(), self.learner.spec), out,
                               self.cfg.model.path, write=self.rank0, dtype=self.cfg.model.dtype)
            self.progress.note(f"final policy exported as a Hugging Face checkpoint: {out}")
        if self.rank0:
            from mugrpo_megatron.report import write_report

            path = write_report(self.run_dir)
            self.progress.note(f"report: {path}")

    def rollout(self, phase: Phase, times: PhaseTimes) -> PhaseData:
        """The phase's scored samples with advantages, opened from disk on every rank; generated
        first unless an earlier start finished generating this phase."""
        directory = phase_dir(self.run_dir, phase.index)
        if not self._from_rank0(is_generated(directory) if self.rank0 else None):
            times.sync = self.sync_weights()  # into the engine's weights, woken alone
            with self.learner_offloaded(times):
                t0 = time.perf_counter()
                self.engines.wake()  # the KV cache, now that the learner stepped aside
                times.switch += time.perf_counter() - t0
                self.generate(phase, directory, times)
                self.mark_memory("generate", phase.index)
                t0 = time.perf_counter()
                self.engines.sleep()
                times.switch += time.perf_counter() - t0
        return PhaseData(directory, drop_uniform=self.cfg.algo.uniform_groups != "keep")

    def behaviour_from_learner(self, phase: Phase, data: PhaseData, times: PhaseTimes) -> None:
        """``algo.behaviour_logprobs: learner``: the learner scores every response of the phase
        before its first update (its weights are still the ones the engine sampled from); rank 0
        writes the log-probs beside the shards, and the phase's ratios divide by them. A resume
        finds them there (``phase.checks.score_behaviour``)."""
        if not self._from_rank0(data.has_learner_logprobs() if self.rank0 else None):
            if self.start_update > phase.first_update:
                raise RunFailed(f"phase {phase.index}: the learner's behaviour log-probs are "
                                f"missing in {data.directory}, and the learner has trained past "
                                f"the phase's start, so they cannot be computed again")
            times.extra.update(score_behaviour(
                self.learner, data, self.cfg.algo.samples_per_update,
                self.pad_id, write=self.rank0))
        data.use_learner_logprobs()

    @contextmanager
    def learner_offloaded(self, times: PhaseTimes | None = None):
        """The learner's weights and optimizer state in host memory while the engine works
        (``parallel.offload_learner``); back on the device, bit for bit, afterwards."""
        if not self.offload:
            yield
            return
        out = self.learner.offload()
        try:
            yield
        except BaseException:
            if getattr(self, "engines", None) is not None:
                self.engines.sleep()  # failing anyway: at least not both on the device at once
            self.learner.onload()
            raise
        if self.engines.kv_cache_awake:
            # weights, gradients and Adam state beside the KV cache: what the dry run does not
            # budget for (an out-of-memory error hours into a run at 70B)
            raise RuntimeError("the learner would return to the device while the engine's KV "
                               "cache is awake: sleep the engine first")
        back = self.learner.onload()
        if times is not None:
            times.switch += out.seconds + back.seconds
            times.extra.update(offload_seconds=out.seconds, onload_seconds=back.seconds,
                               offload_gib=out.bytes_freed / 2**30)

    def sync_weights(self) -> float:
        """Stream the learner's weights into the engine (collective); returns the seconds taken,
        0 when the engine already holds the learner's current weights."""
        if self._engine_has == self.learner.num_updates:
            return 0.0
        t0 = time.perf_counter()
        self.engines.wake(weights_only=True)  # a sleeping engine has no weights to update
        stream = iter_hf_tensors(self.learner.chunks(), self.learner.spec,
                                 bucket_bytes=self.cfg.rollout.weight_bucket_mb << 20)
        try:
            self.engines.update_weights(stream)
        except EngineFailed as e:
            raise RunFailed(f"weight sync into the engine failed: {e}. Nothing of the learner "
                            f"was lost; resume from {self.ckpt_dir} by running again.") from None
        self.mark_memory("sync")
        self._engine_has = self.learner.num_updates
        return time.perf_counter() - t0

    def generate(self, phase: Phase, directory: Path, times: PhaseTimes) -> None:
        """Every replica streams its share of the groups not yet on disk, its leader scores and
        writes shards as groups finish, and rank 0 indexes the phase (``generate_phase``)."""
        t0 = time.perf_counter()
        try:
            counts = generate_phase(self.engines, directory, phase, self.cfg.rollout,
                                    self.prompts, self.scorer, self.tokenizer, self.progress,
                                    self.cfg.algo.adv_eps)
        except GenerationFailed as e:
            raise RunFailed(f"phase {phase.index}: generation failed ({e}). Kept: every shard "
                            f"written in {directory}; resume by running again.") from None
        times.generate = time.perf_counter() - t0
        times.score = counts.score_wait_seconds  # rank 0's leader, blocked on its reward pool
        times.extra.update(counts.metrics(times.generate))
        for message in counts.messages:
            self.progress.note(f"reward: {message}")

    def optimize(self, phase: Phase, data: PhaseData, times: PhaseTimes) -> None:
        """mu updates over the phase's samples; checkpoints; per-update and per-phase metrics."""
        train = data.train_rows  # phase rows the updates draw from (uniform groups dropped?)
        gap = self.mismatch_check(data)
        packing = self.check_packing(data)
        quantum = self.learner.layout.dp_size * self.cfg.parallel.micro_batch_size
        size = self.schedule.update_size(len(train), self.cfg.algo.uniform_groups == "drop_once",
                                         quantum) if len(train) else 0
        used = 0  # samples the phase's updates take, all mu of them (resumed or not)
        first = max(self.start_update, phase.first_update)
        bar = self.progress.bar(f"phase {phase.index} optimize",
                                total=phase.first_update + phase.num_updates - first)
        skipped, t_eval = 0, 0.0
        t_opt = time.perf_counter()
        t_data = 0.0
        for mb in (self.schedule.minibatches(phase, len(train), size) if len(train) else []):
            rows = train[np.asarray(mb.sample_indices, dtype=np.int64)]
            rows = rows[:len(rows) - len(rows) % quantum]
            used += len(rows)
            if mb.update < first:
                continue
            if not len(rows):
                skipped += 1
                self._log_update(mb.update, {"skipped": True, "reason": "too few samples"})
                bar.update(1)
                continue
            t0 = time.perf_counter()
            # this rank reads its data-parallel share of the update's rows, and nothing else
            batch = data.batch(rows[self.learner.dp_rows(len(rows))],
                               self.pad_id)
            t_data += time.perf_counter() - t0
            step = self.learner.train_step(batch, dp_local=True)
            skipped += step.skipped
            n_tok = int(data.response_len[rows].sum())
            self._log_update(mb.update, {
                "phase": phase.index, "staleness": mb.step_in_phase, "epoch": mb.epoch,
                "samples": len(rows),
                "loss": step.loss, "grad_norm": step.grad_norm, "lr": step.lr,
                "skipped": step.skipped, "reason": step.reason, "seconds": step.seconds,
                "tokens_per_s": n_tok / step.seconds if step.seconds else 0.0,
                "response_len": n_tok / len(rows), "reward": float(data.reward[rows].mean()),
                **{k: v for k, v in step.metrics.items() if not k.startswith("num_")}})
            if step.skipped:
                self.progress.note(f"update {mb.update} skipped ({step.reason}); parameters and "
                                   f"optimizer state untouched, nothing else lost")
            bar.update(1, loss=step.loss, veto=step.metrics.get("veto_frac", 0.0))
            every = self.cfg.checkpoint.save_every_updates
            phase_end = phase.first_update + phase.num_updates
            if every and (mb.update + 1) % every == 0 and mb.update + 1 < phase_end:
                self.save(mb.update + 1, phase.index)
            t_eval += self.evaluate_every(mb.update + 1)
        bar.close()
        self.mark_memory("optimize", phase.index)
        times.optimize = time.perf_counter() - t_opt - t_eval  # the held-out curve is not training
        times.extra["batch_read_seconds"] = t_data  # reading rows from the shards, in optimize
        # the passes over what the updates drew from, as made (the uniform-group policy decides)
        times.extra.update(passes=used / len(train) if len(train) else 0.0,
                           uniform_policy=self.cfg.algo.uniform_groups)
        if t_eval:
            times.extra["eval_seconds"] = t_eval
        self.save(phase.first_update + phase.num_updates, phase.index)
        if packing is not None:
            times.extra.update(pack_check_gap_mean=packing.mean, pack_check_gap_max=packing.max)
        self._log_phase(phase, data, gap, times, skipped)

    def mismatch_check(self, data: PhaseData):
        """Score a few of the engine's own samples, read back from the shards, with the learner:
        the train/inference gap. The rows are spread over the phase, so every replica's share
        (and so every replica's copy of the weights) is checked."""
        return mismatch_gap(self.learner, data, self.cfg.rollout.mismatch_check_samples,
                            self.pad_id)

    def check_packing(self, data: PhaseData) -> LogprobGap | None:
        """Where the learner packs (``parallel.pack_tokens``), once a run, at its first mismatch
        check: the packed path against the padded one (``phase.checks.check_packing``)."""
        if not self.learner.pack_capacity or self._packing_checked:
            return None
        self._packing_checked = True
        return check_packing(self.learner, data, self.cfg, self.pad_id)

    def save(self, update: int, phase: int) -> None:
        save_learner(self.learner, self.ckpt_dir / f"update_{update:07d}",
                     {"update": update, "phase": phase})
        self.mark_memory("save", phase)
        if self.rank0:
            prune(self.ckpt_dir, self.cfg.checkpoint.keep_last)
        self.start_update = update

    def evaluate(self, label: str) -> None:
        if not self.eval_prompts:
            return
        r = self.cfg.rollout
        with self.learner_offloaded():
            self.engines.wake()
            spec = eval_sampling(k=r.eval_samples, max_new_tokens=r.max_new_tokens,
                                 temperature=r.temperature)
            gens = self.engines.generate([p.token_ids for p in self.eval_prompts], spec)
            self.mark_memory("evaluate")
            self.engines.sleep()  # before the learner comes back to the device
        if not self.rank0:
            return
        res = score_eval(gens, self.eval_prompts, self.scorer, self.tokenizer)
        self.log.log("eval", self.learner.num_updates, {"label": label, **res.as_dict()})
        self.progress.note(f"held-out ({label}): mean@{res.k} {res.mean_at_k:.3f}, "
                           f"pass@{res.k} {res.pass_at_k:.3f} on {res.num_prompts} prompts")

    def evaluate_every(self, update: int) -> float:
        """The held-out curve (``logging.eval_every_updates``): after ``update`` when it is a
        multiple, except the run's last, which ``evaluate('after')`` scores. ``evaluate`` leaves
        the engine asleep, as the optimizer expects it. Returns the seconds it took (0 when it
        skips)."""
        every = self.cfg.logging.eval_every_updates
        if not every or update % every or update >= self.cfg.algo.total_updates:
            return 0.0
        t0 = time.perf_counter()
        self.sync_weights()
        self.evaluate(f"update {update}")
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        self.engines.shutdown()
        self.prompts.close()
        self.log.close()

    # ---------------------------------------------------------------- helpers

    def mark_memory(self, transition: str, phase: int | None = None) -> None:
        """A 'memory' record (rank 0) at each transition of a phase (the ones the dry run
        budgets: start, sync, generate, evaluate, optimize, save): where the learner's state
        and the engine's memory are, and on a GPU the device memory in use and the allocator's
        peak since the previous mark, so a run's real peaks can be read against the estimate."""
        if not self.rank0:
            return
        values = {"transition": transition, "phase": phase, "engine": self.engines.memory
                  if getattr(self, "engines", None) is not None else "starting",
                  "learner_on_device": not self.learner.offloaded}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            values.update(device_used_gib=(total - free) / 2**30,
                          allocator_peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        self.log.log("memory", self.learner.num_updates, values)

    def _from_rank0(self, obj):
        """Rank 0's ``obj`` on every rank (what it generated, or a decision it took)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _warn(self, message: str) -> None:
        """Something the user must see whatever logging.progress says (rank 0): on stderr, and as
        an event in metrics.jsonl."""
        if self.rank0:
            print(f"warning: {message}", file=sys.stderr, flush=True)
            self.log.log("event", self.start_update, {"warning": message})

    def _log_update(self, update: int, values: dict) -> None:
        self.log.log("update", update, values)

    def _log_phase(self, phase, data: PhaseData, gap, times: PhaseTimes, skipped) -> None:
        if not self.rank0:
            return
        stats = data.stats()
        values = {
            "phase": phase.index, "first_update": phase.first_update, **stats,
            "engine_replicas": self.engines.num_replicas,
            "skipped_updates": skipped, "sync_seconds": times.sync, "switch_seconds": times.switch,
            "generate_seconds": times.generate, "score_seconds": times.score,
            "optimize_seconds": times.optimize, **times.extra,
        }
        if gap is not None:
            values.update(logprob_gap_mean=gap.mean, logprob_gap_max=gap.max)
        self.log.log("phase", phase.first_update + phase.num_updates, values)
        self.progress.note(
            f"phase {phase.index}: reward {stats['reward_mean']:.3f}, {stats['uniform_groups']} "
            f"uniform groups, generate {times.generate:.1f}s, sync {times.sync:.2f}s, "
            f"optimize {times.optimize:.1f}s"
            + (f", train/infer gap {gap.mean:.2e} (max {gap.max:.2e})" if gap else ""))


def train(cfg: Config, start: str) -> int:
    """The ``train`` command, once the layout and the run directory (``run_dir.check``, which
    gave ``start``) are checked on every rank: the default group, the ranks' agreement on the
    run directory before any model, engine or data, then the run. Returns the exit status; a
    failure the user can act on is printed, not raised."""
    distributed.init_default_group(cfg.parallel.timeout_minutes)
    start = run_dir.agree(cfg, start)
    trainer = None
    try:
        trainer = Trainer(cfg, start)
        trainer.run()
    except (RunFailed, DiskFull, distributed.RemoteFailure) as e:
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
    return 0

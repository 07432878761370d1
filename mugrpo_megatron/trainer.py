"""The Mu-GRPO loop: for each phase, sync weights, generate, score, advantages once, then mu updates.

GRPO (mu = 4) and Mu-GRPO (mu = 1024) are configs of this one loop. Every rank runs the learner
and drives the rollout engines collectively (``engines.fleet``: a tensor-parallel rank of a
replica on every rank, or one engine on global rank 0). Global rank 0 also holds the reward
workers and the rollout store, and hands the phase's samples to the other ranks.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from mugrpo_megatron.config import Config
from mugrpo_megatron.config_loader import to_dict
from mugrpo_megatron.data import load_prompts
from mugrpo_megatron.engines import SamplingSpec
from mugrpo_megatron.engines.fleet import EngineFleet
from mugrpo_megatron.evaluation import eval_sampling, score_eval
from mugrpo_megatron.learner.checkpoint import load_learner, prune, save_learner, usable_checkpoint
from mugrpo_megatron.learner.export import iter_hf_tensors, save_hf_checkpoint
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.metrics import MetricsLogger
from mugrpo_megatron.progress import Progress
from mugrpo_megatron.rewards import RewardScorer
from mugrpo_megatron.rollout import Sample, logprob_gap, to_batch, uniform_groups, with_advantages
from mugrpo_megatron.rollout_store import RolloutStore
from mugrpo_megatron.run_dir import record_start
from mugrpo_megatron.scheduler import Phase, PhaseScheduler


class RunFailed(RuntimeError):
    """A failure that ends the run; the message says what was kept and how to resume."""


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

        The config must already have been checked for the world size (``check_world_size``) and
        the run directory for this start (``run_dir.check``, which returns ``start``)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.learner = Learner(cfg)
        self.rank0 = dist.get_rank() == 0
        if self.rank0:
            record_start(cfg, start, dist.get_world_size())
        dist.barrier()  # no rank looks into the run directory before it is this run's
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.prompts, report = load_prompts(cfg.data, self.tokenizer)
        self.eval_prompts, _ = load_prompts(cfg.data, self.tokenizer, held_out=True)
        self.schedule = PhaseScheduler(cfg.algo, cfg.rollout.group_size, len(self.prompts))
        self.store = RolloutStore(self.run_dir)
        self.log = MetricsLogger(cfg.logging, self.run_dir, self.rank0, to_dict(cfg))
        self.progress = Progress(enabled=self.rank0 and cfg.logging.progress)
        off = cfg.parallel.offload_learner
        self.offload = off == "always" or (off == "auto" and torch.cuda.is_available())
        self.scorer = None
        if self.rank0:
            self.progress.note(f"data: {report.summary()}; held out: {len(self.eval_prompts)}")
            self.scorer = RewardScorer(cfg.reward)
        # the engine sizes its memory from what is free when it starts: the learner steps aside
        with self.learner_offloaded():
            self.engines = EngineFleet.start(
                cfg.rollout, cfg.model.path, dtype=cfg.model.dtype,
                max_model_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens,
                trust_remote_code=cfg.model.trust_remote_code)
            self.engines.sleep()  # awake only to generate (and take weights), not while training
        self.progress.note(f"rollout: {self.engines.describe()}")
        # the learner update whose weights the engine holds (None: the checkpoint it started from)
        self._engine_has: int | None = None
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
            samples = self.rollout(phase, times)
            self.optimize(phase, samples, times)
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

    def rollout(self, phase: Phase, times: PhaseTimes) -> list[Sample]:
        """The phase's scored samples with advantages: from disk if this phase already generated."""
        samples = self.store.final(phase.index) if self.rank0 else None
        if self._from_rank0(samples is None):
            times.sync = self.sync_weights()  # into the engine's weights, woken alone
            with self.learner_offloaded(times):
                t0 = time.perf_counter()
                self.engines.wake()  # the KV cache, now that the learner stepped aside
                times.switch += time.perf_counter() - t0
                samples = self.generate(phase, times)
                t0 = time.perf_counter()
                self.engines.sleep()
                times.switch += time.perf_counter() - t0
        return self._from_rank0(samples)

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
        finally:
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
        _, error = self.engines.update_weights(stream)
        if error:
            raise RunFailed(f"weight sync into the engine failed: {error}. Nothing of the learner "
                            f"was lost; resume from {self.ckpt_dir} by running again.")
        self._engine_has = self.learner.num_updates
        return time.perf_counter() - t0

    def generate(self, phase: Phase, times: PhaseTimes) -> list[Sample] | None:
        """G samples per prompt (collective), scored and persisted chunk by chunk on rank 0, then
        advantages; the phase's samples on rank 0, None on the other ranks."""
        r = self.cfg.rollout
        chunk = r.generate_chunk_prompts
        done = self.store.parts(phase.index) if self.rank0 else {}
        kept = self._from_rank0(sorted(done))  # every rank skips the same chunks
        samples: list[Sample] = []
        bar = self.progress.bar(f"phase {phase.index} generate", total=len(phase.prompt_indices))
        # sample j of the phase's k-th prompt has seed phase_seed + k * G + j, however the prompts
        # are chunked and split over engine replicas
        phase_seed = (r.seed * 1_000_003 + phase.index * 10_007) % 2**31 * 2**31
        for part, start in enumerate(range(0, len(phase.prompt_indices), chunk)):
            rows = phase.prompt_indices[start:start + chunk]
            if part in kept:
                samples += done.get(part, [])
                bar.update(len(rows))
                continue
            t0 = time.perf_counter()
            spec = SamplingSpec(n=r.group_size, max_new_tokens=r.max_new_tokens,
                                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                seed=phase_seed + start * r.group_size)
            try:
                gens = self.engines.generate([self.prompts[i].token_ids for i in rows], spec)
            except Exception as e:
                raise RunFailed(
                    f"phase {phase.index}: the engine failed on prompts {start}..{start + len(rows)}"
                    f" ({type(e).__name__}: {e}). Kept: {part} generated chunks in "
                    f"{self.store.root}; resume by running again.") from e
            times.generate += time.perf_counter() - t0
            if not self.rank0:
                continue
            t0 = time.perf_counter()
            new = [Sample(phase.index, i, start + j, self.prompts[i].token_ids, g.token_ids,
                          g.logprobs, g.finish_reason)
                   for j, (i, group) in enumerate(zip(rows, gens)) for g in group]
            texts = [self.tokenizer.decode(list(s.response_ids), skip_special_tokens=True)
                     for s in new]
            outcome = self.scorer.score(texts, [self.prompts[s.prompt_index].answer for s in new])
            for msg in outcome.errors:
                self.progress.note(f"reward: {msg}")
            times.extra["reward_timeouts"] = times.extra.get("reward_timeouts", 0) + outcome.num_timeouts
            times.extra["reward_errors"] = times.extra.get("reward_errors", 0) + outcome.num_errors
            new = [replace(s, reward=rw) for s, rw in zip(new, outcome.rewards)]
            self.store.write_part(phase.index, part, new)
            times.score += time.perf_counter() - t0
            samples += new
            bar.update(len(rows))
        bar.close()
        if not self.rank0:
            return None
        samples = with_advantages(samples, r.group_size, self.cfg.algo.adv_eps)
        self.store.write_final(phase.index, samples)
        return samples

    def optimize(self, phase: Phase, samples: list[Sample], times: PhaseTimes) -> None:
        """mu updates over the phase's samples; checkpoints; per-update and per-phase metrics."""
        a, g = self.cfg.algo, self.cfg.rollout.group_size
        uniform = uniform_groups(samples, g)
        train = [s for s in samples if s.group not in uniform] if a.drop_uniform_groups else samples
        gap = self.mismatch_check(samples)
        quantum = self.learner.layout.dp_size * self.cfg.parallel.micro_batch_size
        first = max(self.start_update, phase.first_update)
        bar = self.progress.bar(f"phase {phase.index} optimize",
                                total=phase.first_update + phase.num_updates - first)
        skipped, t_eval = 0, 0.0
        t_opt = time.perf_counter()
        for mb in (self.schedule.minibatches(phase, len(train)) if train else []):
            if mb.update < first:
                continue
            rows = [train[i] for i in mb.sample_indices]
            rows = rows[:len(rows) - len(rows) % quantum]
            if not rows:
                skipped += 1
                self._log_update(mb.update, {"skipped": True, "reason": "too few samples"})
                bar.update(1)
                continue
            step = self.learner.train_step(to_batch(rows, self.tokenizer.pad_token_id or 0))
            skipped += step.skipped
            n_tok = sum(len(s.response_ids) for s in rows)
            self._log_update(mb.update, {
                "phase": phase.index, "staleness": mb.step_in_phase, "epoch": mb.epoch,
                "loss": step.loss, "grad_norm": step.grad_norm, "lr": step.lr,
                "skipped": step.skipped, "reason": step.reason, "seconds": step.seconds,
                "tokens_per_s": n_tok / step.seconds if step.seconds else 0.0,
                "response_len": n_tok / len(rows), "reward": sum(s.reward for s in rows) / len(rows),
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
        times.optimize = time.perf_counter() - t_opt - t_eval  # the held-out curve is not training
        if t_eval:
            times.extra["eval_seconds"] = t_eval
        self.save(phase.first_update + phase.num_updates, phase.index)
        self._log_phase(phase, samples, train, uniform, gap, times, skipped)

    def mismatch_check(self, samples: list[Sample]):
        """Score a few of the engine's own samples with the learner: the train/inference gap."""
        n = self.cfg.rollout.mismatch_check_samples
        if n == 0 or not samples:
            return None
        n -= n % self.learner.layout.dp_size
        if n == 0:
            return None
        batch = to_batch(samples[:n], self.tokenizer.pad_token_id or 0)
        logp, _ = self.learner.logprobs(batch)
        return logprob_gap(logp, batch)

    def save(self, update: int, phase: int) -> None:
        save_learner(self.learner, self.ckpt_dir / f"update_{update:07d}",
                     {"update": update, "phase": phase})
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
        if not self.rank0:
            return
        res = score_eval(gens, self.eval_prompts, self.scorer, self.tokenizer)
        self.log.log("eval", self.learner.num_updates, {"label": label, **res.as_dict()})
        self.progress.note(f"held-out ({label}): mean@{res.k} {res.mean_at_k:.3f}, "
                           f"pass@{res.k} {res.pass_at_k:.3f} on {res.num_prompts} prompts")

    def evaluate_every(self, update: int) -> float:
        """The held-out curve (``logging.eval_every_updates``): after ``update`` when it is a
        multiple, except the run's last, which ``evaluate('after')`` scores. Leaves the engine
        asleep, as the optimizer expects it. Returns the seconds it took (0 when it skips)."""
        every = self.cfg.logging.eval_every_updates
        if not every or update % every or update >= self.cfg.algo.total_updates:
            return 0.0
        t0 = time.perf_counter()
        self.sync_weights()
        self.evaluate(f"update {update}")
        self.engines.sleep()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.rank0:
            self.scorer.close()
        self.engines.shutdown()
        self.log.close()

    # ---------------------------------------------------------------- helpers

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

    def _log_phase(self, phase, samples, train, uniform, gap, times: PhaseTimes, skipped) -> None:
        if not self.rank0:
            return
        n = len(samples)
        rewards = [s.reward for s in samples]
        mean = sum(rewards) / n
        values = {
            "phase": phase.index, "first_update": phase.first_update, "reward_mean": mean,
            "reward_std": (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5,
            "num_samples": n, "num_train_samples": len(train),
            "epochs": self.schedule.epochs_per_phase(len(train)) if train else 0.0,
            "uniform_groups": len(uniform),
            "uniform_group_frac": len(uniform) * self.cfg.rollout.group_size / n,
            "response_len": sum(len(s.response_ids) for s in samples) / n,
            "truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
            "engine_replicas": self.engines.num_replicas,
            "skipped_updates": skipped, "sync_seconds": times.sync, "switch_seconds": times.switch,
            "generate_seconds": times.generate, "score_seconds": times.score,
            "optimize_seconds": times.optimize, **times.extra,
        }
        if times.generate:
            values["generate_tokens_per_s"] = sum(len(s.response_ids) for s in samples) / times.generate
        if gap is not None:
            values.update(logprob_gap_mean=gap.mean, logprob_gap_max=gap.max)
        self.log.log("phase", phase.first_update + phase.num_updates, values)
        self.progress.note(
            f"phase {phase.index}: reward {mean:.3f}, {len(uniform)} uniform groups, "
            f"generate {times.generate:.1f}s, sync {times.sync:.2f}s, optimize {times.optimize:.1f}s"
            + (f", train/infer gap {gap.mean:.2e} (max {gap.max:.2e})" if gap else ""))

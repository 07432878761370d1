"""What the learner scores of a generated phase besides training on it: the train/inference
log-prob gap (every phase), the packed path against the padded one (once a run), and, with
``algo.behaviour_logprobs: learner``, the behaviour log-probs of every response, with
``algo.kl_target: reference`` the reference policy's.

All collective: every rank calls them with the same phase, and ``Learner.logprobs`` splits the
rows over the data-parallel ranks and returns them whole on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mugrpo_megatron import distributed
from mugrpo_megatron.config import Config
from mugrpo_megatron.layout import round_up
from mugrpo_megatron.outputs import RunFailed
from mugrpo_megatron.phase.batches import LogprobGap, logprob_gap, response_span
from mugrpo_megatron.phase.data import (
    BEHAVIOUR_FILE,
    REFERENCE_FILE,
    LearnerLogprobWriter,
    PhaseData,
)
from mugrpo_megatron.rollout_correction import Correction, CorrectionStats, correct

PACKING_CHECK_ROWS = 8
"""Rows of a phase scored both packed and padded at a run's first mismatch check."""


def spread_rows(num_samples: int, n: int, dp: int) -> np.ndarray:
    """``n`` rows spread evenly over a phase (so over every replica's share), raised to a multiple
    of the data-parallel size ``dp``, so that every data-parallel rank scores at least one (the
    learner splits them over its ranks): at DP 16 a check of 4 rows scores 16. A phase with fewer
    samples than that has its rows repeated. Empty only for ``n`` = 0 (the check is off)."""
    if n < 1 or num_samples < 1:
        return np.zeros(0, dtype=np.int64)
    n = round_up(n, dp)
    rows = np.unique(np.linspace(0, num_samples - 1, min(n, num_samples)).round().astype(np.int64))
    return np.resize(rows, round_up(len(rows), dp))


def mismatch_gap(learner, data: PhaseData, n: int) -> LogprobGap | None:
    """|learner log-prob - engine log-prob| on ``n`` of the engine's own samples (at least one
    a data-parallel rank), read back from the shards: the train/inference gap of the weights the
    engine sampled with. None when the check is off (``n`` = 0)."""
    rows = spread_rows(data.num_samples, n, learner.layout.dp_size)
    if len(rows) == 0:
        return None
    batch = data.batch(rows, engine_logprobs=True)
    logp, _ = learner.logprobs(batch)
    return logprob_gap(logp, batch)


def packing_tolerance(cfg: Config) -> float:
    """The mean |log p packed - log p padded| over response tokens above which packing is taken
    to be broken. The two paths differ only in kernels and summation order: ~1e-6 in fp32, a few
    1e-3 in bf16, more with FP8's per-tensor scales (its activations' amax depends on the rows a
    tensor holds). Attention across the sequences of a row (a layout mistake) changes every
    later sequence of the row by far more: 0.38 nats a token on average, 2.1 at most, on the tiny
    model of ``tests/test_trainer.py``, where correct packing differs by 4e-7."""
    tolerance = 1e-3 if cfg.model.dtype == "float32" else 0.05
    return 2 * tolerance if cfg.model.fp8_format else tolerance


def check_packing(learner, data: PhaseData, cfg: Config) -> LogprobGap:
    """Score rows spread over the phase packed and padded; ``RunFailed`` if they differ beyond
    ``packing_tolerance``. On a GPU packing runs Transformer Engine's THD attention, kernels and
    layout rules that no CPU test runs; the padded path is the one every layout test checks.
    Two forward passes of a few rows."""
    rows = spread_rows(data.num_samples, PACKING_CHECK_ROWS, learner.layout.dp_size)
    batch = data.batch(rows)
    packed, _ = learner.logprobs(batch)
    padded, _ = learner.logprobs(batch, packed=False)
    diff = logprob_gap(packed, replace(batch, behav_logp=padded))
    tolerance = packing_tolerance(cfg)
    if diff.mean > tolerance:
        path = "Transformer Engine's THD attention" if learner.uses_thd else \
            "a block-diagonal attention mask"
        raise RunFailed(
            f"packed sequences score differently from padded ones: mean |log p packed - "
            f"log p padded| {diff.mean:.3g} (max {diff.max:.3g}) over {diff.num_tokens} "
            f"response tokens of {len(rows)} rows, above the {tolerance:g} that "
            f"{cfg.model.dtype}{' with FP8' if cfg.model.fp8_format else ''} allows. Packing "
            f"goes through {path}, which computes something else on this setup; no update of "
            f"this start trained on it. Set parallel.pack_tokens: 0 to pad instead (more "
            f"tokens an update: see its docs), and please report this with your Transformer "
            f"Engine and megatron-core versions. Everything in {cfg.logging.run_dir} was kept; "
            f"the run resumes with the same command.")
    return diff


def score_behaviour(learner, data: PhaseData, chunk: int, write: bool,
                    correction: Correction | None = None
                    ) -> tuple[LogprobGap, dict[str, float] | None]:
    """The learner's log-prob of every response token of the phase (``BEHAVIOUR_FILE``), with its
    weights as they are (the ones the engine sampled from, before the phase's first update):
    ``score_phase``. With a ``correction`` (``algo.rollout_is`` / ``rollout_rs``), its numbers
    over every token too (``CorrectionStats.record``), from the log-probs the pass has in hand."""
    stats = CorrectionStats() if correction is not None else None

    def measure(batch, logp, n: int) -> None:
        mask = batch.response_mask[:n]
        weight, keep = correct(logp[:n], batch.behav_logp[:n], mask, correction)
        stats.add(mask, weight, keep, correction)

    gap = score_phase(lambda batch: learner.logprobs(batch)[0], learner.layout.dp_size, data,
                      chunk, write, BEHAVIOUR_FILE, "the learner's behaviour log-probs",
                      each=measure if stats is not None else None)
    return gap, stats.record() if stats is not None else None


def score_reference(learner, data: PhaseData, chunk: int, write: bool) -> LogprobGap:
    """The reference policy's log-prob of every response token of the phase (``REFERENCE_FILE``),
    its weights swapped into the learner's once for the whole pass
    (``Learner.reference_weights``): ``score_phase``. The gap returned is the reference's to the
    engine's behaviour log-probs."""
    with learner.reference_weights():
        return score_phase(lambda batch: learner.logprobs(batch)[0], learner.layout.dp_size,
                           data, chunk, write, REFERENCE_FILE, "the reference policy's log-probs")


def score_phase(score, dp: int, data: PhaseData, chunk: int, write: bool, name: str,
                what: str, each=None) -> LogprobGap:
    """``score(batch)``'s log-prob of every response token of the phase, ``chunk`` rows at a
    time, written beside the shards as ``name`` by the rank with ``write``
    (``phase.data.LearnerLogprobWriter``). Returns the gap to the engine's log-probs over every
    response token (the same on every rank). Every rank reads every row of a chunk
    (``Learner.logprobs`` splits it over the ``dp`` data-parallel ranks): the phase's shards DP
    times in all, once a phase."""
    n = data.num_samples
    chunk = max(dp, chunk // dp * dp)
    writer = LearnerLogprobWriter(data.directory, n, name) if write else None
    gap = LogprobGap()
    explain = (f"writing {what} into {data.directory} failed ({{}}). Kept: the phase's shards "
               f"and index; resume by running again.").format
    with distributed.agreed(RunFailed, explain) as failure:
        for lo in range(0, n, chunk):
            rows = np.arange(lo, min(lo + chunk, n))
            padded = np.concatenate([rows, np.full(-len(rows) % dp, rows[-1])])  # DP splits it
            batch = data.batch(padded, engine_logprobs=True)
            logp = score(batch)
            gap = gap + logprob_gap(logp, batch, rows=len(rows))
            if each is not None:  # (batch, log-probs, its rows that are the chunk's)
                each(batch, logp, len(rows))
            mask = batch.response_mask
            if writer is not None and not failure.error:
                with failure.kept():  # the writer keeps scoring in step with the others
                    writer.add([logp[k][response_span(mask[k])].numpy()
                                for k in range(len(rows))])
        if writer is not None and not failure.error:
            with failure.kept():
                writer.commit()
        if writer is not None and failure.error:
            writer.abort()
    return gap

"""``python -m mugrpo_megatron rollouts RUN_DIR --phase N --show K``: a phase's rollouts, readable.

Prints a summary of the phase (samples, groups, reward, advantage, response length, finish
reasons, uniform groups) and K decoded samples with their reward, advantage and length.

The summary streams the parquet files record batch by record batch and reads only the columns it
needs, so memory is bounded by one batch (16k responses) plus one int32 per response (the length
percentiles) and one pair of floats per group: at 10^6 responses and 10^9 tokens it reads the
~4 GB token column once, batch by batch, and keeps ~12 MB. Only the K samples shown are decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_SUMMARY_COLUMNS = ["group", "reward", "advantage", "finish_reason", "response_ids"]
_BATCH_ROWS = 16_384


@dataclass
class PhaseSummary:
    files: list[Path]
    complete: bool
    """Whether the phase finished generating (final.parquet, with advantages)."""
    num_samples: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    adv_sum: float = 0.0
    adv_abs_sum: float = 0.0
    adv_neg: int = 0
    length_sum: int = 0
    length_max: int = 0
    finish: dict[str, int] = field(default_factory=dict)
    groups: dict[int, tuple[float, float]] = field(default_factory=dict)
    """group -> (min reward, max reward): one pair per prompt, for the uniform-group count."""
    lengths: list[np.ndarray] = field(default_factory=list)

    def text(self, phase: int) -> str:
        n = max(self.num_samples, 1)
        mean = self.reward_sum / n
        std = math.sqrt(max(self.reward_sq_sum / n - mean * mean, 0.0))
        uniform = sum(lo == hi for lo, hi in self.groups.values())
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(1)
        p50, p95 = np.percentile(lengths, [50, 95])
        state = ("complete (final.parquet, with advantages)" if self.complete else
                 f"generation not finished: {len(self.files)} part file(s), no advantages yet")
        lines = [
            f"phase {phase}: {state}",
            f"  samples {self.num_samples} in {len(self.groups)} groups; "
            f"uniform groups {uniform} ({uniform / max(len(self.groups), 1):.1%})",
            f"  reward mean {mean:.4f}, std {std:.4f}",
            f"  response tokens: mean {self.length_sum / n:.1f}, median {p50:.0f}, "
            f"p95 {p95:.0f}, max {self.length_max}; total {self.length_sum}",
            "  finish reasons: " + ", ".join(f"{k} {v} ({v / n:.1%})"
                                             for k, v in sorted(self.finish.items())),
        ]
        if self.complete:
            lines.append(f"  advantage mean {self.adv_sum / n:+.4f}, mean |A| "
                         f"{self.adv_abs_sum / n:.4f}, A < 0 for {self.adv_neg / n:.1%}")
        return "\n".join(lines)


def phase_files(run_dir: Path, phase: int) -> tuple[list[Path], bool]:
    """The phase's parquet files (final.parquet alone when it exists) and whether it is final."""
    d = run_dir / "rollouts" / f"phase_{phase:04d}"
    if not d.is_dir():
        have = sorted(p.name for p in (run_dir / "rollouts").glob("phase_*")) \
            if (run_dir / "rollouts").is_dir() else []
        raise ValueError(f"{d}: no rollouts for phase {phase} (phases on disk: "
                         f"{', '.join(have) or 'none'})")
    final = d / "final.parquet"
    if final.exists():
        return [final], True
    parts = sorted(d.glob("part_*.parquet"))
    if not parts:
        raise ValueError(f"{d}: no final.parquet and no part_*.parquet files")
    return parts, False


def summarize(files: list[Path], complete: bool) -> PhaseSummary:
    s = PhaseSummary(files, complete)
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS,
                                                       columns=_SUMMARY_COLUMNS):
            reward = batch.column("reward").to_numpy(zero_copy_only=False)
            adv = batch.column("advantage").to_numpy(zero_copy_only=False)
            lengths = pc.list_value_length(batch.column("response_ids")).to_numpy(
                zero_copy_only=False).astype(np.int64)
            s.num_samples += len(reward)
            s.reward_sum += float(reward.sum())
            s.reward_sq_sum += float((reward * reward).sum())
            s.adv_sum += float(adv.sum())
            s.adv_abs_sum += float(np.abs(adv).sum())
            s.adv_neg += int((adv < 0).sum())
            s.length_sum += int(lengths.sum())
            s.length_max = max(s.length_max, int(lengths.max(initial=0)))
            s.lengths.append(lengths.astype(np.int32))
            counts = pc.value_counts(batch.column("finish_reason"))
            for item in counts.to_pylist():
                s.finish[item["values"]] = s.finish.get(item["values"], 0) + item["counts"]
            # per-group reward range in one pass over the batch (a group may span two batches):
            # a dict entry per group, 1.25e5 at 10^6 responses and G = 8, ~20 MB
            ids, inverse = np.unique(batch.column("group").to_numpy(zero_copy_only=False),
                                     return_inverse=True)
            lo, hi = np.full(len(ids), math.inf), np.full(len(ids), -math.inf)
            np.minimum.at(lo, inverse, reward)
            np.maximum.at(hi, inverse, reward)
            for g, a, b in zip(ids.tolist(), lo.tolist(), hi.tolist()):
                old_lo, old_hi = s.groups.get(g, (math.inf, -math.inf))
                s.groups[g] = (min(old_lo, a), max(old_hi, b))
    return s


def pick_rows(files: list[Path], rows: list[int]) -> list[dict]:
    """The given global row numbers of the phase (ascending), read batch by batch."""
    out, want, base = [], sorted(rows), 0
    for path in files:
        f = pq.ParquetFile(path)
        for batch in f.iter_batches(batch_size=_BATCH_ROWS):
            inside = [r - base for r in want if base <= r < base + batch.num_rows]
            if inside:
                out += pa.Table.from_batches([batch]).take(inside).to_pylist()
            base += batch.num_rows
            if base > want[-1]:
                return out
    return out


def show(run_dir: Path, phase: int, k: int, tokenizer=None) -> str:
    files, complete = phase_files(run_dir, phase)
    summary = summarize(files, complete)
    text = [summary.text(phase)]
    if k and summary.num_samples:
        step = max(summary.num_samples // k, 1)  # spread over the phase, first of each stretch
        rows = list(range(0, summary.num_samples, step))[:k]
        for row, r in zip(rows, pick_rows(files, rows)):
            text.append(f"\n--- sample {row}: prompt row {r['prompt_index']}, group {r['group']}, "
                        f"reward {r['reward']:.3f}, advantage "
                        + (f"{r['advantage']:+.3f}" if complete else "- (phase not finished)")
                        + f", "
                        f"{len(r['response_ids'])} tokens, finish {r['finish_reason']}")
            if tokenizer is None:
                text.append(f"prompt ids: {r['prompt_ids']}\nresponse ids: {r['response_ids']}")
            else:
                text.append("[prompt] " + tokenizer.decode(r["prompt_ids"]))
                text.append("[response] " + tokenizer.decode(r["response_ids"]))
    return "\n".join(text)

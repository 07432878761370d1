"""``python -m mugrpo_megatron rollouts RUN_DIR --phase N --show K``: a phase's rollouts, readable.

Prints a summary of the phase (samples, groups, reward, advantage, response length, finish
reasons, uniform groups) and K decoded samples with their reward, advantage and length.

The summary maps the phase's shards (``phase.store``) one at a time and reads only the columns it
needs (the token column's offsets, not its values), so memory is bounded by one shard's small
columns plus one int32 per response (the length percentiles), one pair of floats per group and,
for a generated phase, the index's advantage column: ~30 MB at 10^6 responses. Only the K samples
shown are decoded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from mugrpo_megatron.phase.store import column, is_generated, open_table, phase_dir, shard_paths


@dataclass
class PhaseSummary:
    files: list[Path]
    complete: bool
    """Whether the phase finished generating (index.arrow, with advantages)."""
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
        state = (f"complete ({len(self.files)} shard(s) and index.arrow, with advantages)"
                 if self.complete else
                 f"generation not finished: {len(self.files)} shard(s), no advantages yet")
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
    """The phase's shards and whether the phase is generated (its index written)."""
    d = phase_dir(run_dir, phase)
    if not d.is_dir():
        have = sorted(p.name for p in (run_dir / "rollouts").glob("phase_*")) \
            if (run_dir / "rollouts").is_dir() else []
        raise ValueError(f"{d}: no rollouts for phase {phase} (phases on disk: "
                         f"{', '.join(have) or 'none'})")
    shards = shard_paths(d)
    if not shards:
        raise ValueError(f"{d}: no shard_*.arrow files (a phase written by an older version "
                         f"holds part_*.parquet files, which this version does not read)")
    return shards, is_generated(d)


def summarize(files: list[Path], complete: bool) -> PhaseSummary:
    s = PhaseSummary(files, complete)
    for path in files:
        t = open_table(path)
        reward = column(t, "reward")
        lengths = np.diff(t.column("response_ids").chunk(0).offsets.to_numpy()).astype(np.int64)
        s.num_samples += len(reward)
        s.reward_sum += float(reward.sum())
        s.reward_sq_sum += float((reward * reward).sum())
        s.length_sum += int(lengths.sum())
        s.length_max = max(s.length_max, int(lengths.max(initial=0)))
        s.lengths.append(lengths.astype(np.int32))
        for item in pc.value_counts(t.column("finish_reason")).to_pylist():
            s.finish[item["values"]] = s.finish.get(item["values"], 0) + item["counts"]
        # a shard holds whole groups: one np.unique per shard, a dict entry per group
        # (1.25e5 at 10^6 responses and G = 8, ~20 MB)
        ids, inverse = np.unique(column(t, "group"), return_inverse=True)
        lo, hi = np.full(len(ids), math.inf), np.full(len(ids), -math.inf)
        np.minimum.at(lo, inverse, reward)
        np.maximum.at(hi, inverse, reward)
        s.groups.update(zip(ids.tolist(), zip(lo.tolist(), hi.tolist())))
    if complete:
        adv = column(open_table(files[0].parent / "index.arrow"), "advantage")
        s.adv_sum, s.adv_abs_sum = float(adv.sum()), float(np.abs(adv).sum())
        s.adv_neg = int((adv < 0).sum())
    return s


def pick_rows(files: list[Path], complete: bool, rows: list[int]) -> list[dict]:
    """The given row numbers of the phase: in phase order (group, then sample) when it is
    generated, else in shard order."""
    if complete:
        index = open_table(files[0].parent / "index.arrow")
        names = [p.name for p in files]
        shard_names = json.loads(index.schema.metadata[b"shards"])
        shard, row, adv = (column(index, k) for k in ("shard", "row", "advantage"))
        where = [(names.index(shard_names[shard[r]]), int(row[r]), float(adv[r])) for r in rows]
    else:
        sizes = np.cumsum([0] + [open_table(p).num_rows for p in files])
        where = [(int(np.searchsorted(sizes, r, side="right") - 1), 0, None) for r in rows]
        where = [(s, r - int(sizes[s]), None) for (s, _, _), r in zip(where, rows)]
    out = []
    for shard, row, adv in where:
        rec = open_table(files[shard]).slice(row, 1).to_pylist()[0]
        rec["advantage"] = adv
        out.append(rec)
    return out


def show(run_dir: Path, phase: int, k: int, tokenizer=None) -> str:
    files, complete = phase_files(run_dir, phase)
    summary = summarize(files, complete)
    text = [summary.text(phase)]
    if k and summary.num_samples:
        step = max(summary.num_samples // k, 1)  # spread over the phase, first of each stretch
        rows = list(range(0, summary.num_samples, step))[:k]
        for row, r in zip(rows, pick_rows(files, complete, rows)):
            text.append(f"\n--- sample {row}: prompt row {r['prompt_index']}, group {r['group']}, "
                        f"reward {r['reward']:.3f}, advantage "
                        + (f"{r['advantage']:+.3f}" if complete else "- (phase not finished)")
                        + f", {len(r['response_ids'])} tokens, finish {r['finish_reason']}")
            if tokenizer is None:
                text.append(f"prompt ids: {r['prompt_ids']}\nresponse ids: {r['response_ids']}")
            else:
                text.append("[prompt] " + tokenizer.decode(r["prompt_ids"]))
                text.append("[response] " + tokenizer.decode(r["response_ids"]))
    return "\n".join(text)


def show_run(run_dir: Path, phase: int | None, k: int, ids: bool) -> str:
    """The ``rollouts`` command: ``show`` of phase ``phase`` (default: the newest on disk) of
    the run in ``run_dir``, decoded with the run's tokenizer unless ``ids``."""
    if not (run_dir / "rollouts").is_dir():
        raise ValueError(f"{run_dir}: not a run directory with rollouts (no rollouts/ in it)")
    if phase is None:
        phase = max(int(p.name.split("_")[1]) for p in (run_dir / "rollouts").glob("phase_*"))
    phase_files(run_dir, phase)  # a missing phase is named before the tokenizer loads
    tokenizer = None
    if not ids:
        from transformers import AutoTokenizer

        from mugrpo_megatron.config.loader import load_config

        cfg = load_config(str(run_dir / "config.yaml"), [])
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    return show(run_dir, phase, k, tokenizer)

"""The ``score`` command: completions of one's own scored exactly as training scores them, to
check a reward on one's data before a run.

    python -m mugrpo_megatron score --config CFG --completions FILE.jsonl [--out FILE]

Each line of ``FILE.jsonl`` is ``{"row": i, "completion": "..."}``: ``i`` is the row of
``data.path`` (0-based, counting every row of the file as read, after the field mapping; a
mixture's lines add ``"file": k``, the index into ``data.path``, 0 by default). Each completion is
scored by the reward its row's source is routed to (``reward.by_source``, else
``reward.name``), given what the function takes of the row (the prompt as rendered, the source,
the metadata), in the scorer's worker processes, under the same timeouts, checks of the returned
value and sandbox (``reward.sandbox``) as training. Each result is a line ``{"row": i, "file":
k, "source": ..., "score": s}`` (``"failed": true`` where scoring failed), in order, to
``--out`` (refused if it exists, unless ``--overwrite``) or stdout; the summary (mean score, by
source, failures by source with the first few named by row and error, as a run names them) goes
to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mugrpo_megatron import outputs
from mugrpo_megatron.config import Config
from mugrpo_megatron.rewards import RewardScorer, RowInfo
from mugrpo_megatron.rewards.scorer import describe_failures


def read_completions(path: Path, num_files: int) -> list[tuple[int, int, str]]:
    """(file, row, completion) of each line; ValueError naming the line and field."""
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--completions: cannot read {path} ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--completions: {path} line {n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object {{\"row\": i, \"completion\": ...}}")
        row, completion, file = item.get("row"), item.get("completion"), item.get("file", 0)
        for name, value, kind in (("row", row, int), ("file", file, int),
                                  ("completion", completion, str)):
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got "
                                 f"{value!r}"[:200])
        if not 0 <= file < num_files:
            raise ValueError(f"{where}: file {file} is not an index into data.path "
                             f"({num_files} file(s))")
        out.append((file, row, completion))
    if not out:
        raise ValueError(f"--completions: {path} has no completions")
    return out


def score_file(cfg: Config, completions: Path, out: str | None = None,
               overwrite: bool = False, explain: bool = False) -> dict:
    """The ``score`` command (the module docstring); returns the summary. ``explain``: each code
    row's line says why it scores what it does (``rewards.code.explain``: the program run again,
    in this process)."""
    from mugrpo_megatron.data import iter_prompt_chunks
    from mugrpo_megatron.data.prompt_store import check_routes
    from mugrpo_megatron.inputs import CodeTruths, check_rewards, load_tokenizer
    from mugrpo_megatron.types import LoadReport

    if out:
        outputs.check_destination(out, [completions], overwrite=overwrite, what="--out",
                                  directory=False)
    items = read_completions(Path(completions), len(cfg.data.paths))
    check_rewards(cfg)
    model = Path(cfg.model.path) if cfg.model.path else None
    tokenizer = load_tokenizer(cfg) if model and (model / "config.json").is_file() else None
    wanted = {(f, r) for f, r, _ in items}
    rows: dict[tuple[int, int], RowInfo] = {}
    answers: dict[tuple[int, int], str] = {}
    sources: set[str] = set()
    truths = CodeTruths(cfg)  # what plan checks, checked here too
    for f, path in enumerate(cfg.data.paths):
        key = f"data.path[{f}]" if len(cfg.data.paths) > 1 else "data.path"
        for chunk in iter_prompt_chunks(cfg.data, tokenizer, LoadReport(source=path), path=path):
            sources.update(chunk.sources)
            truths.see(key, chunk)
            for j, row in enumerate(chunk.rows):
                if (f, row) in wanted:
                    text = chunk.texts[j] if chunk.texts else ""
                    rows[f, row] = RowInfo(chunk.sources[j], text, chunk.metadata[j], row)
                    answers[f, row] = chunk.answers[j]
    if cfg.reward.by_source:
        check_routes(cfg, sorted(sources))  # a by_source key no row has: refused, as plan does
    if said := truths.line():
        print(f"[score] {said}", file=sys.stderr, flush=True)
    for f, row, _ in items:
        if (f, row) not in rows:
            raise ValueError(f"--completions: data.path[{f}] ({cfg.data.paths[f]}) has no usable "
                             f"row {row} (past its end, or skipped as a bad row)")
    with RewardScorer(cfg.reward) as scorer:
        if tokenizer is None and any("prompt" in s.takes for s in scorer.specs):
            raise ValueError("model.path: a reward takes the prompt as rendered, which needs "
                             "the model's tokenizer (its chat template): set model.path")
        outcome = scorer.score([c for _, _, c in items], [answers[f, r] for f, r, _ in items],
                               [rows[f, r] for f, r, _ in items])
    failed = set(outcome.failed)
    lines, by_source = [], {}
    for i, ((f, row, _), score) in enumerate(zip(items, outcome.rewards)):
        source = rows[f, row].source
        by_source.setdefault(source, []).append(score)
        line = {"row": row, "file": f, "source": source, "score": score}
        if i in failed:
            line["failed"] = True
        if explain:
            line["why"] = _why(cfg, source, items[i][2], answers[f, row], outcome, i)
        lines.append(json.dumps(line))
    text = "\n".join(lines) + "\n"
    if out:
        outputs.write_file(out, text)
    else:
        sys.stdout.write(text)
    summary = {"completions": len(items),
               "mean_score": sum(outcome.rewards) / len(items),
               "by_source": {s: sum(v) / len(v) for s, v in sorted(by_source.items())},
               "failed": outcome.num_failed, "failed_by_source": outcome.failed_by_source,
               "failure_examples": outcome.errors}
    failures = describe_failures(outcome.num_failed, len(items), outcome.failed_by_source,
                                 outcome.errors) if outcome.num_failed else ""
    print(f"[score] {len(items)} completions, mean score {summary['mean_score']:.4f} ("
          + ", ".join(f"{s} {v:.4f}" for s, v in summary["by_source"].items()) + ")"
          + (f"; reward: {failures}" if failures else ""), file=sys.stderr, flush=True)
    return summary


def _why(cfg: Config, source: str, completion: str, answer: str, outcome, i: int) -> str:
    """``score --explain``'s reason for one completion."""
    from mugrpo_megatron.rewards.code import explain
    from mugrpo_megatron.rewards.sandbox import SandboxSpec

    if i in outcome.failed:
        return "the reward failed (see the failures on stderr)"
    if cfg.reward.by_source.get(source, cfg.reward.name) != "code":
        return "a reward without reasons (only the code reward explains its scores)"
    return explain(completion, answer, SandboxSpec.of(cfg.reward))

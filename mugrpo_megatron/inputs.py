"""The run's inputs, checked before any process group exists: the reward functions (every rank:
an import and a signature each) and, on global rank 0, the data: every held-out set loaded, the
training prompts tokenized into the run's prompt file, and every ``reward.by_source``
key matched to a source. A bad row, message, field or route is an error naming the file, row and
field or key, in seconds, with nothing written (``prompt_store.write_prompt_file`` removes what
it made), instead of after megatron's groups, the model and the engines were built.

The prompt file is written beside the run directory, not in it (``prompt_store.staging_dir``):
until every rank agreed that it sees the directory rank 0 sees (``run_dir.agree``), nothing goes
into it, so another rank's ``run_dir.check`` never finds rank 0's half-made files, and a start
that stops there leaves nothing (``prompt_store.discard_staging``). The other ranks do not wait
for this before they start their default group: they wait in its first collective
(``run_dir.agree``), for as long as ``parallel.timeout_minutes`` allows (rank 0 tokenizes ~10^4
prompts a second: 10^6 in ~2 minutes); if rank 0 stops here, torchrun stops them. Once the
groups exist, ``prompt_store.open_prompt_set`` moves the file in (a rename) and every rank
opens it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mugrpo_megatron.config import Config


def check_inputs(cfg: Config, overwrite: bool = False) -> list[str]:
    """What ``plan`` and ``train --dry-run`` read of a run's inputs: the checks ``train`` makes
    before its process groups, said in lines, with ValueError where ``train`` would refuse.

    Every reward function imported and its signature checked (``check_rewards``); every row of
    every data file and held-out set through the row checks ``train`` makes (fields, types,
    messages, sources; ``data.on_bad_row``), without tokenizing a whole set: where the model's
    tokenizer is on this machine, each file's first ``CHUNK_ROWS`` prompts are rendered as the
    engine gets them and held to ``data.max_prompt_tokens`` (``train`` checks every prompt);
    every ``reward.by_source`` key against the sources found; whether the run's draws can hold
    ``data.weights`` (``phase.schedule.mixture_coverage``); and what starting in
    ``logging.run_dir`` would do (``run_dir.check``: new, resume, replace, or refused). A data
    file or model directory that is not on this machine is said, not refused: a dry run may
    plan on a laptop for a cluster's files."""
    from mugrpo_megatron import run_dir
    from mugrpo_megatron.data import CHUNK_ROWS, iter_prompt_chunks
    from mugrpo_megatron.data.prompt_store import check_routes
    from mugrpo_megatron.data.readers import DataNotFound
    from mugrpo_megatron.phase.schedule import mixture_coverage
    from mugrpo_megatron.rewards import reward_specs
    from mugrpo_megatron.types import LoadReport

    check_rewards(cfg)  # imports, signatures, the sandbox where a function runs programs
    specs, route = reward_specs(cfg.reward)
    names = {"reward.name": specs[0], **{f"reward.by_source.{k}": specs[i]
                                         for k, i in route.items()}}
    lines = ["rewards: " + "; ".join(
        f"{k} {v.path}" + (f" (takes {', '.join(sorted(v.takes))})" if v.takes else "")
        for k, v in names.items()) + ": each imported, its signature checked"]
    model = Path(cfg.model.path) if cfg.model.path else None
    tokenizer = None
    if model is not None and (model / "config.json").is_file():
        try:
            tokenizer = load_tokenizer(cfg)
        except (OSError, ValueError) as e:
            raise ValueError(f"model.path: cannot load the tokenizer of {model}: {e}") from e
    sources: dict[str, int] = {}
    absent: list[str] = []
    truths = CodeTruths(cfg)
    sets = [(f"data.path[{i}]" if len(cfg.data.paths) > 1 else "data.path", path, False)
            for i, path in enumerate(cfg.data.paths)]
    sets += [(f"data.eval_path.{name}" if isinstance(cfg.data.eval_path, dict)
              else "data.eval_path", path, True) for name, path in cfg.data.eval_sets.items()]
    for key, path, held_out in sets:
        report, found, longest = LoadReport(source=path), {}, 0
        try:
            for chunk in iter_prompt_chunks(cfg.data, tokenizer, report, held_out=held_out,
                                            path=path, key=key, tokenize_rows=CHUNK_ROWS):
                truths.see(key, chunk)
                for s in chunk.sources:
                    found[s] = found.get(s, 0) + 1
                longest = max([longest, *map(len, chunk.token_ids)])
        except DataNotFound as e:
            absent.append(key)
            lines.append(f"{key}: not on this machine, not checked ({e})")
            continue
        for s, n in found.items():
            sources[s] = sources.get(s, 0) + n
        lengths = (f"; its first {min(CHUNK_ROWS, report.num_kept)} prompts rendered: the longest "
                   f"{longest} tokens of data.max_prompt_tokens {cfg.data.max_prompt_tokens}"
                   if tokenizer is not None else "; prompt lengths not checked (no tokenizer: "
                   "model.path is not on this machine)")
        lines.append(f"{key}: {report.summary()}; sources: "
                     + ", ".join(f"{s} {n}" for s, n in sorted(found.items())) + lengths)
    if cfg.reward.by_source and absent:
        lines.append(f"reward.by_source: not checked against the sources ({', '.join(absent)} "
                     f"not on this machine)")
    elif cfg.reward.by_source:
        check_routes(cfg, list(sources))
        lines.append("reward.by_source: every key names a source of the data")
    if said := truths.line():
        lines.append(said)
    if cfg.rollout.tools and tokenizer is not None:  # as train and eval will warn
        from mugrpo_megatron.trajectory import ToolSetup, tool_warnings
        from mugrpo_megatron.trajectory.render import TurnRenderer
        from mugrpo_megatron.trajectory.tools import resolve_tools

        renderer = TurnRenderer(tokenizer, [t.schema for t in resolve_tools(cfg.rollout.tools)],
                                ToolSetup.of(cfg, tokenizer).template_kwargs)
        lines += [f"warning: {w}" for w in tool_warnings(cfg.rollout, renderer)]
    if coverage := mixture_coverage(cfg):
        lines.append(coverage)
    if tokenizer is None:
        lines.append("logging.run_dir: not checked (model.path is not on this machine)")
    else:
        start = run_dir.check(cfg, overwrite=overwrite)
        lines.append(f"logging.run_dir: {cfg.logging.run_dir}: " + {
            "new": "a new run", "resume": "resumes the run there (same fingerprint)",
            "replace": "replaced (--overwrite)", "finished": "holds this run, finished: "
            "train says so and does nothing"}[start])
    return lines


class CodeTruths:
    """Every ground truth of a row routed to the code reward, parsed as its test cases
    (``rewards.code.parse_cases``), as ``plan`` and ``score`` read the rows: a bad one is a
    reward failure of every response to that row in training."""

    def __init__(self, cfg: Config):
        self.cfg, self.parsed, self.bad = cfg, 0, 0
        self.examples: list[str] = []
        """The first few bad rows with their error (only the count of the rest is kept: 10^6
        rows' ground truths are parsed one at a time, none held)."""

    def see(self, key: str, chunk) -> None:
        from mugrpo_megatron.rewards.code import parse_cases

        r = self.cfg.reward
        for source, answer, row in zip(chunk.sources, chunk.answers, chunk.rows):
            if r.by_source.get(source, r.name) != "code":
                continue
            self.parsed += 1
            try:
                parse_cases(answer)
            except ValueError as e:
                self.bad += 1
                if len(self.examples) < 5:
                    self.examples.append(f"{key} row {row} ({source}): {e}")

    def line(self) -> str | None:
        """The finding in a line; ValueError where training would stop at the first bad row
        (``reward.on_error: raise``)."""
        if not self.parsed:
            return None
        if not self.bad:
            return f"code ground truths: all {self.parsed} parsed as test cases"
        said = (f"code ground truths: {self.bad} of {self.parsed} are not test cases (each "
                f"response to them is a reward failure): " + "; ".join(self.examples))
        if self.cfg.reward.on_error == "raise":
            raise ValueError(said + ". reward.on_error is 'raise', so training would stop at "
                                    "the first: fix the rows, or drop them from the data")
        return said


def check_rewards(cfg: Config) -> None:
    """Every reward function the run may call imports and takes what the scorer gives
    (``rewards.reward_specs``); ValueError naming the setting otherwise. Every rank. Where a
    function runs programs (it takes ``sandbox``: the code reward), or the policy's python tool
    does (``rollout.tools``, whose every entry is imported and its schema read here too), the
    sandbox runs one here first (``sandbox.probe``: ``SandboxUnavailable``, a ValueError naming
    the cause and the choices), or, with ``reward.sandbox: unsafe``, a warning that nothing is
    isolated."""
    from mugrpo_megatron.rewards import reward_specs
    from mugrpo_megatron.rewards.sandbox import UNSAFE, SandboxSpec, probe
    from mugrpo_megatron.trajectory.tools import PYTHON, resolve_tools

    specs, _ = reward_specs(cfg.reward)
    resolve_tools(cfg.rollout.tools)
    if not any("sandbox" in s.takes for s in specs) and PYTHON not in cfg.rollout.tools:
        return
    if cfg.reward.uses_code and "boxed" in cfg.data.instruction:
        print(f"warning: data.instruction is {cfg.data.instruction!r}, a math instruction, and "
              f"the code reward scores a fenced python block, which it does not ask for: set "
              f"data.instruction to the code instruction your rows expect, or '' (the shipped "
              f"configs/qwen2.5-coder-7b_8xh100_code.yaml does)", file=sys.stderr, flush=True)
    if cfg.reward.sandbox == UNSAFE:
        print("warning: reward.sandbox is 'unsafe': the programs the policy writes run with the "
              "limits of reward.sandbox_* but no isolation at all (they see this machine's files,"
              " network and processes as the scorer does). Use it only for programs you trust; "
              "reward.sandbox: bwrap runs them in the OS sandbox.", file=sys.stderr, flush=True)
        return
    for note in probe(SandboxSpec.of(cfg.reward)):
        print(f"warning: {note}", file=sys.stderr, flush=True)


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.path,
                                         trust_remote_code=cfg.model.trust_remote_code)


def prepare_data(cfg: Config, start: str, tokenizer=None, note=lambda _: None, bar=None
                 ) -> list[Path]:
    """Global rank 0, before any process group: load every held-out set (the trainer loads them
    again on every rank: a few thousand prompts); tokenize the training prompts into the staging
    directory beside the run directory (``prompt_store.staging_dir``; ``open_prompt_set`` moves
    the file in once every rank agreed on the run directory) unless the run directory (for a
    start that keeps it) or the staging directory holds it complete. Returns the directories it
    made, deepest first, for ``prompt_store.discard_staging`` if the start goes no further.
    ValueError for bad data, nothing written."""
    from mugrpo_megatron.data import load_eval_sets
    from mugrpo_megatron.data.prompt_store import (
        prompt_key,
        prompt_paths,
        staging_dir,
        write_prompt_file,
    )

    tokenizer = tokenizer or load_tokenizer(cfg)
    sets = load_eval_sets(cfg.data, tokenizer)
    key, directory = prompt_key(cfg), Path(cfg.logging.run_dir)
    if start != "replace" and prompt_paths(directory, key)[1].is_file():
        note(f"prompts: reusing {prompt_paths(directory, key)[0]}")
        return []
    path, done = prompt_paths(staging_dir(directory), key)
    if done.is_file():
        note(f"prompts: reusing {path}")
        return []
    made = [d for d in (path.parent, *path.parents) if not d.exists()]
    write_prompt_file(cfg, tokenizer, path, done, bar,
                      other_sources=sorted({p.source for prompts, _ in sets.values()
                                            for p in prompts}))
    return made

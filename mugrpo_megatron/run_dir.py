"""A run directory knows what it is: the fingerprint of what its data depends on, checked on resume.

``run.json`` (written when the run starts) holds the run's fingerprint: every config key that
shapes its rollouts, checkpoints or schedule, plus hashes of the model's config and tokenizer
files and of the data files. A later start in the same directory compares its own fingerprint and
refuses any difference, listing each field, so that one run's persisted rollouts and checkpoints
are never mixed with another model, tokenizer, data set, group size, chunking, seed or schedule.
What is safe to change on resume (``SAFE_TO_CHANGE``: logging, the learner's layout, engine
placement and memory, checkpoint cadence, reward workers, held-out sampling) is left out of the
fingerprint. A key added to the config after a run's record was written counts as unchanged
while it holds its default.

Each start's whole config is kept: ``config.yaml`` is the first, ``config.1.yaml``,
``config.2.yaml``... the starts after it; none is overwritten.

``check`` reads files only and runs before any process group exists, on every rank (each hashes
the data file it is about to read anyway). ``agree`` runs right after the default group exists and
before anything is built: every rank proves that it sees rank 0's run directory (rank 0 writes a
token there, every rank reads it back) and the same model and data files, and that all reached the
same decision (new, resume, replace). Shards written by each replica's leader, the index rank 0
writes and the checkpoints every rank writes only make one run if they land in one directory.
``replace_run`` and ``record_start`` write, on rank 0 only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mugrpo_megatron import distributed
from mugrpo_megatron.config import Config
from mugrpo_megatron.config.loader import dump_yaml, to_dict
from mugrpo_megatron.models.hf_config import TOKENIZER_FILES
from mugrpo_megatron.outputs import move_aside, write_file

RUN_FILE = "run.json"
FINISHED_FILE = "finished.json"
"""Written by rank 0 once a run has run every update, evaluated, exported and reported: a start
that finds it says the run is finished and does nothing (``finished_message``)."""
SAFE_TO_CHANGE = (
    "logging.", "parallel.", "rollout.tensor_parallel", "rollout.placement",
    "rollout.gpu_memory_utilization", "rollout.cpu_kv_cache_gib", "rollout.sleep_between_phases",
    "rollout.weight_bucket_mb", "rollout.mismatch_check_samples", "rollout.shard_prompts",
    "rollout.max_inflight_prompts", "rollout.max_num_seqs", "reward.num_workers",
    "reward.batch_responses", "reward.timeout_s", "reward.on_error", "checkpoint.save_every_updates",
    "checkpoint.save_at_phase_end", "checkpoint.keep_last", "checkpoint.resume",
    "checkpoint.export_hf", "model.recompute", "eval.",
)
"""Config keys (or key prefixes) that a resumed run may change: how the work is laid out and
logged, not what it computes. The distributed optimizer's sharding is checked when a checkpoint
loads (``learner.checkpoint.load_learner``)."""
_MODEL_FILES = ("config.json", *TOKENIZER_FILES)


def fingerprint(cfg: Config) -> dict[str, Any]:
    """The run-defining config keys (dotted) and content hashes of the model and data files."""
    out = {k: v for k, v in _flat(to_dict(cfg)).items()
           if not any(k == s or (s.endswith(".") and k.startswith(s)) for s in SAFE_TO_CHANGE)}
    model = Path(cfg.model.path)
    out["model.files_sha256"] = {name: _sha256(model / name) for name in _MODEL_FILES
                                 if (model / name).is_file()}
    data = cfg.data
    for key, paths in (("data.path", data.paths), ("data.eval_path", tuple(data.eval_sets.values()))):
        hashes = [_sha256(Path(p)) if Path(p).is_file() else None for p in paths]
        if any(hashes):  # one file's hash as before mixtures and named sets; several as a list
            out[f"{key}_sha256"] = hashes[0] if len(hashes) == 1 else hashes
    return out


def _added_since(key: str, value: Any) -> bool:
    """Whether ``key`` is a config key added after a run's record was written, and ``value``
    its default: no difference for a resume (the run ran with what the default does)."""
    defaults = _flat(to_dict(Config()))
    return key in defaults and defaults[key] == value


def check(cfg: Config, *, overwrite: bool) -> str:
    """What starting this run in ``logging.run_dir`` would do: 'new' (nothing there yet),
    'resume' (a run with the same fingerprint), 'finished' (that run, finished: nothing to do)
    or 'replace' (``--overwrite``). ValueError, naming each differing field, for anything else.
    Reads only."""
    model = Path(cfg.model.path)
    if not cfg.model.path:
        raise ValueError("model.path: not set; name the Hugging Face checkpoint directory to start "
                         "from, in the config or with --set model.path=DIR")
    if not (model / "config.json").is_file():
        raise ValueError(f"model.path: {model} " + ("has no config.json: is it a Hugging Face "
                         "checkpoint directory?" if model.is_dir() else "is not a directory"))
    run_dir = Path(cfg.logging.run_dir)
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise ValueError(f"logging.run_dir: {run_dir} is a file, not a directory")
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return "new"
    if overwrite:
        return "replace"
    record = run_dir / RUN_FILE
    if not record.is_file():
        raise ValueError(f"logging.run_dir: {run_dir} is not empty and holds no {RUN_FILE}, so it "
                         f"is not a run directory of this tool (or predates run fingerprints); "
                         f"nothing was changed. Choose a new logging.run_dir, or pass --overwrite "
                         f"to replace the directory.")
    if not cfg.checkpoint.resume:
        raise ValueError(f"logging.run_dir: {run_dir} holds a run and checkpoint.resume is false. "
                         f"Set checkpoint.resume=true to continue it, choose a new logging.run_dir "
                         f"for a new run, or pass --overwrite to replace it.")
    try:
        saved = json.loads(record.read_text())["fingerprint"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{record}: unreadable ({type(e).__name__}: {e}); the run cannot be "
                         f"checked for resume") from None
    now = fingerprint(cfg)
    diffs = [f"  {k}: the run has {saved.get(k, '(absent)')!r}, now {now.get(k, '(absent)')!r}"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)
             and not (k not in saved and _added_since(k, now[k]))]
    finished = (run_dir / FINISHED_FILE).is_file()
    if diffs:
        safe = ", ".join(k + "*" if k.endswith(".") else k for k in SAFE_TO_CHANGE)
        raise ValueError(
            f"logging.run_dir: {run_dir} holds a run that differs from this config in what its "
            f"rollouts and checkpoints depend on, so it cannot be resumed:\n" + "\n".join(diffs)
            + f"\nTo start a new run, choose a new logging.run_dir (or pass --overwrite to replace "
              f"this one); to continue this run, use its config ({run_dir / 'config.yaml'}). "
              f"Safe to change on resume: {safe}"
            + (f"\nThe run is finished. {_train_further(run_dir)}" if finished else ""))
    return "finished" if finished else "resume"


def mark_finished(cfg: Config, updates: int) -> None:
    """Rank 0, at the end of a run: the run is finished (``FINISHED_FILE``)."""
    write_file(Path(cfg.logging.run_dir) / FINISHED_FILE, json.dumps(
        {"finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "updates": updates}, indent=1))


def finished_message(cfg: Config) -> str:
    """What ``train`` says for a run that is finished (``check`` gave 'finished')."""
    run_dir = Path(cfg.logging.run_dir)
    try:
        done = json.loads((run_dir / FINISHED_FILE).read_text())
        when = f"{done['updates']} updates, finished {done['finished']}"
    except (OSError, ValueError, KeyError, TypeError):
        when = "finished"
    return (f"logging.run_dir: {run_dir} holds this run, and it is finished ({when}): nothing "
            f"to do. Its report: {run_dir / 'report.md'}. {_train_further(run_dir)}")


def _train_further(run_dir: Path) -> str:
    checkpoints = sorted((run_dir / "checkpoints").glob("update_*"))
    last = checkpoints[-1] if checkpoints else run_dir / "checkpoints" / "update_N"
    return (f"To train further, start a new run (a new logging.run_dir) "
            f"from its final policy: --set model.path={run_dir / 'hf'} (the exported Hugging Face "
            f"checkpoint), or --set checkpoint.load_from={last} (with the optimizer's and the "
            f"learning-rate schedule's state); --overwrite replaces this run instead.")


TOKEN_FILE = ".mugrpo-rank0-token"
"""What rank 0 writes into the run directory at start for the other ranks to read back."""


def agree(cfg: Config, start: str) -> str:
    """Collective (every rank, once the default group exists, before any other work): that every
    rank sees the directory rank 0 sees as ``logging.run_dir``, reads the same model and data
    files, and took the same ``start`` (from ``check``). Returns ``start``; ValueError on every
    rank, naming the ranks, hosts and paths, otherwise. Costs two small all-gathers and a token
    file of 32 bytes; nothing when the world has one rank."""
    rank, size = distributed.world()
    if size == 1:
        return start
    run_dir = Path(cfg.logging.run_dir)
    mine = {"host": distributed.host(), "path": os.path.abspath(run_dir), "start": start,
            "fingerprint": fingerprint(cfg)}
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine)
    fix = ("logging.run_dir must be one directory that every node mounts, with the same "
           "contents: give an absolute path on shared storage (a relative one resolves against "
           "each node's working directory), and the same model.path and data files everywhere.")
    first = everyone[0]
    for r, other in enumerate(everyone):
        if other["start"] != first["start"]:
            raise ValueError(
                f"logging.run_dir: the ranks see different run directories: rank 0 on "
                f"{first['host']} sees {first['path']} as a {_start_words(first['start'])}, rank "
                f"{r} on {other['host']} sees {other['path']} as a "
                f"{_start_words(other['start'])}. Nothing was written. {fix}")
        if other["fingerprint"] != first["fingerprint"]:
            keys = sorted(k for k in set(first["fingerprint"]) | set(other["fingerprint"])
                          if first["fingerprint"].get(k) != other["fingerprint"].get(k))
            raise ValueError(
                f"rank {r} on {other['host']} reads other model or data files than rank 0 on "
                f"{first['host']} (differing: {', '.join(keys)}). Nothing was written. {fix}")
    token, made = uuid.uuid4().hex, []
    if rank == 0:
        made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / TOKEN_FILE).write_text(token)
    dist.barrier()
    seen = [None] * size
    dist.all_gather_object(seen, _read_token(run_dir / TOKEN_FILE, cfg.logging.run_dir_wait_s))
    if rank == 0:
        token_seen = [s == token for s in seen]
        (run_dir / TOKEN_FILE).unlink()
        if not all(token_seen):
            for d in made:  # made only for the token: leave the file system as it was
                d.rmdir()
    else:
        token_seen = None
    blind = [r for r, ok in enumerate(distributed.from_rank0(token_seen)) if not ok]
    if blind:
        r = blind[0]
        raise ValueError(
            f"logging.run_dir: rank {r} on {everyone[r]['host']} does not see the run directory "
            f"rank 0 on {first['host']} writes: rank 0 wrote a token into {first['path']}, rank "
            f"{r} looked in {everyone[r]['path']} and " + ("found another" if seen[r] else
                                                              "found none")
            + f" ({len(blind)} of {size} ranks did not see it). Nothing was generated or "
              f"trained. {fix}")
    return start


def _start_words(start: str) -> str:
    return {"new": "new run", "resume": "run to resume", "finished": "finished run",
            "replace": "directory to replace (--overwrite)"}[start]


def _read_token(path: Path, wait_s: float) -> str | None:
    """The token in ``path``; retried for up to ``wait_s`` seconds, since a network file system's
    attribute cache can hide a file another node just made (NFS: up to acdirmax, 60 s by
    default) from a node that looked for it before."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return path.read_text()
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)


def replace_run(cfg: Config) -> None:
    """Rank 0, for a start that ``check`` found to be 'replace' (``--overwrite``), before it
    writes anything there: the old directory moved aside and deleted."""
    shutil.rmtree(move_aside(Path(cfg.logging.run_dir)))


def record_start(cfg: Config, world_size: int) -> None:
    """Rank 0, after ``check`` (and ``replace_run``): write ``run.json`` for a new run, and keep
    this start's config beside the earlier ones."""
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / RUN_FILE).is_file():
        write_file(run_dir / RUN_FILE, json.dumps(
            {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "fingerprint": fingerprint(cfg)},
            indent=1))
    name, n = "config.yaml", 0
    while (run_dir / name).exists():
        n += 1
        name = f"config.{n}.yaml"
    (run_dir / name).write_text(f"# start {n} of this run, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                                f"world size {world_size}\n" + dump_yaml(cfg))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()

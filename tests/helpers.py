"""Helpers shared by the tests: tiny batches, responses as Python objects, torchrun launches and
spawned gloo worlds."""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mugrpo_megatron.phase.batches import padded_batch
from mugrpo_megatron.types import TrainBatch

ROOT = Path(__file__).resolve().parents[1]


def make_batch(path: Path, *, vocab: int = 380, batch: int = 8, seq: int = 24, seed: int = 0) -> Path:
    """Random prompt+response rows with behaviour log-probs spread wide enough that the veto and
    the clip both act."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (batch, seq), generator=g)
    resp = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        # the second half is much shorter than the first: data-parallel ranks pack their halves
        # into different numbers of rows
        start, length = 5 + b % 4, 6 + (b * 3) % 12 if b < batch // 2 else 1 + b % 4
        resp[b, start:min(seq, start + length)] = True
        tokens[b, min(seq, start + length):] = 0  # right padding
    behav = torch.where(resp, torch.rand(batch, seq, generator=g) * 12 - 8, torch.zeros(batch, seq))
    nan = behav.clone()
    nan[1, 7] = float("nan")
    advantages = torch.randn(batch, generator=g)
    # a reference policy's log-probs, near the behaviour's (KL terms to a reference)
    ref = torch.where(resp, behav + torch.randn(batch, seq, generator=g), torch.zeros(batch, seq))
    # importance weights from an engine's sampling (algo.rollout_is): every layout must carry
    # each token's own to its loss (1 outside responses)
    weight = torch.where(resp, 0.25 + 1.75 * torch.rand(batch, seq, generator=g),
                         torch.ones(batch, seq))
    save_file({"tokens": tokens, "response_mask": resp.to(torch.uint8), "behav_logp": behav,
               "advantages": advantages, "nan_behav": nan, "ref_logp": ref,
               "is_weight": weight}, str(path))
    return path


def torchrun(nproc: int, script: Path, *args: str, timeout: int = 600) -> None:
    """Run ``script`` under torchrun with ``nproc`` CPU processes; raise with its output on failure."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")


def torchrun_nodes(nodes: int, script: Path, *args: str, timeout: int = 600) -> None:
    """Run ``script`` as torchrun does on ``nodes`` machines of one process each, here on
    localhost: one launcher a "node" (``--nnodes``, ``--node_rank``), so every rank sees
    ``LOCAL_RANK`` 0 and ``LOCAL_WORLD_SIZE`` 1 as on separate machines, meeting at one
    rendezvous port. Raises with every node's output on failure."""
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryDirectory() as logdir:
        logs = [open(Path(logdir) / f"node{i}.log", "w+") for i in range(nodes)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
             f"--node_rank={i}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
             f"--master_port={port}", str(script), *args], cwd=ROOT, env=env, stdout=logs[i],
            stderr=subprocess.STDOUT) for i in range(nodes)]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
        text = []
        for f in logs:
            f.seek(0)
            text.append(f.read())
            f.close()
    if any(codes):
        raise AssertionError(f"{script} on {nodes} nodes failed ({codes}):\n"
                             + "\n".join(f"--- node {i}\n{t[-6000:]}" for i, t in enumerate(text)))


def load_run(out: Path) -> dict:
    return {"tensors": load_file(str(out / "tensors.safetensors")),
            "weights": load_file(str(out / "weights.safetensors")),
            "grads": load_file(str(out / "grads.safetensors")),
            **json.loads((out / "result.json").read_text())}


def cli_under_torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of ``python -m mugrpo_megatron ARGS`` under torchrun with ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "mugrpo_megatron", *args]


def set_args(sets: dict) -> list[str]:
    """``--set key=value`` for every item of ``sets``."""
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def records(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@dataclass(frozen=True)
class Sample:
    """One response to one prompt as a Python object: for tests, benchmarks and the engine
    contract checks (a phase keeps its responses as arrays in shards, never as these)."""

    phase: int
    """Phase that generated it (the behaviour policy's phase)."""
    prompt_index: int
    """Row of the prompt in the training set."""
    group: int
    """Position of the prompt within the phase; the G samples of a prompt share it."""
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behav_logprobs: tuple[float, ...]
    """The engine's log-prob of each response token when it sampled it."""
    finish_reason: str
    reward: float = 0.0
    advantage: float = 0.0


def to_batch(samples: Sequence[Sample], pad_id: int = 0, multiple_of: int = 1) -> TrainBatch:
    """``padded_batch`` of ``Sample`` objects (tests, benchmarks, the engine contract checks)."""
    return padded_batch([(s.prompt_ids, s.response_ids, s.behav_logprobs) for s in samples],
                        [s.advantage for s in samples], pad_id, multiple_of)


def spawn_ranks(target, *args, ranks: int = 2, timeout: float = 600) -> list[int | None]:
    """``target(rank, *args)`` in ``ranks`` fresh processes (spawned: no state of this one),
    each killed past ``timeout`` seconds; their exit codes. The targets form their gloo world
    themselves, through a file rendezvous (``gloo_world``), so no port is raced for."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args), daemon=True) for r in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def gloo_world(rank: int, ranks: int, directory: str | Path, minutes: float = 60) -> None:
    """Join a gloo world of ``ranks`` through a rendezvous file in ``directory``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank,
                            world_size=ranks, timeout=datetime.timedelta(minutes=minutes))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers start sessions of their own, so killing
    the launcher's process group alone would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a run and everything it started, at once, as a crash or an OOM killer would."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def train_command(sets: dict, ranks: int = 1) -> list[str]:
    """``python -m mugrpo_megatron train --set ...``: in one process, or under torchrun."""
    if ranks > 1:
        return cli_under_torchrun(ranks, "train", *set_args(sets))
    return [sys.executable, "-m", "mugrpo_megatron", "train", *set_args(sets)]


def launch(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (so it can be killed whole), its output appended to
    ``log_path``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    with open(log_path, "a") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_until_done(cmd: list[str], log_path: Path, expect: int = 0, env: dict | None = None,
                   timeout: int = 900) -> str:
    """Run ``cmd`` to its end; AssertionError with the log's tail unless its exit code is
    ``expect``. Returns the log."""
    proc = launch(cmd, log_path, env)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert code == expect, log_path.read_text()[-6000:]
    return log_path.read_text()


def kill_when_ready(cmd: list[str], log_path: Path, ready, timeout: int = 600,
                    env: dict | None = None, main_only: bool = False,
                    grace_s: float = 10.0) -> list[int]:
    """Start ``cmd`` and SIGKILL it and everything it started as soon as ``ready()`` holds.
    With ``main_only`` the kill reaches ``cmd``'s process alone, as a user's ``kill -9`` does,
    and every process it had started must be gone within ``grace_s`` seconds (AssertionError
    naming those left; they are killed then). Returns the processes it had started."""
    import time

    proc = launch(cmd, log_path, env)
    deadline = time.monotonic() + timeout
    started: list[int] = []
    try:
        while not ready():
            assert proc.poll() is None, "the run ended before the kill point:\n" + \
                log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "kill point never reached"
            time.sleep(0.02)
        if main_only:
            started = descendants(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            until = time.monotonic() + grace_s
            while (alive := [p for p in started if alive_pid(p)]) and time.monotonic() < until:
                time.sleep(0.1)
            assert not alive, f"left running {grace_s:g} s after the SIGKILL: " + \
                "; ".join(f"{p} {command_line(p)}" for p in alive)
    finally:
        kill_tree(proc.pid)
        for p in started:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    return started


def alive_pid(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def command_line(pid: int) -> str:
    """Process ``pid``'s command line, for messages."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:200]
    except OSError:
        return "(gone)"


def mtimes(paths) -> dict[Path, int]:
    """Each file's modification time (ns): what ``assert_unchanged`` holds them to."""
    return {Path(p): Path(p).stat().st_mtime_ns for p in paths}


def assert_unchanged(seen: dict[Path, int]) -> None:
    """Files kept as they were (``mtimes``): finished work a resume must not redo."""
    for path, mtime in seen.items():
        assert path.stat().st_mtime_ns == mtime, f"{path} was written again"


def eos_prone(hf_dir: Path, strength: float = 0.5) -> Path:
    """Make a tiny random checkpoint end some of its responses: its output row of the EOS token
    turned toward the mean of its last hidden states, so that EOS is likely after some contexts
    (about 4% a token on average at 0.5: ~40% of 12-token responses stop). Random tiny models
    otherwise run to the length limit almost always."""
    import json as _json

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    eos = _json.loads((Path(hf_dir) / "generation_config.json").read_text())["eos_token_id"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        h = model(torch.randint(3, model.config.vocab_size - 3, (16, 40), generator=g),
                  output_hidden_states=True).hidden_states[-1].reshape(-1, model.config.hidden_size)
    mean = h.mean(0)
    weights = load_file(str(Path(hf_dir) / "model.safetensors"))
    weights["lm_head.weight"][eos] = strength * 5 * mean / mean.norm() ** 2
    save_file(weights, str(Path(hf_dir) / "model.safetensors"), metadata={"format": "pt"})
    return Path(hf_dir)


def block_fp8_release(hf_dir: Path, out: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """``hf_dir``'s model as DeepSeek-V3's and Qwen3's FP8 releases ship it: each linear weight of
    the layers in e4m3 with its ``weight_scale_inv`` (one per block, the edge blocks cut short),
    the rest as it was, and ``quantization_config`` in config.json; the tokenizer copied."""
    import shutil

    from mugrpo_megatron.engines.fp8_weights import quantize_stream

    out.mkdir(parents=True)
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file(dict(quantize_stream(tensors.items(), block)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in hf_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy2(f, out / f.name)
    return out

"""The run's data, reward, checkpoints and logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from mugrpo_megatron.config.section import Section


@dataclass(frozen=True)
class DataConfig(Section):
    _name: ClassVar[str] = "data"

    path: str = "builtin:arithmetic"
    """Training prompts: a local .jsonl/.json/.parquet file, a hub dataset id, or
    'builtin:arithmetic' for the offline seeded arithmetic task."""
    split: str = "train"
    """Split to read from a hub dataset."""
    prompt_field: str = "question"
    """Column holding the prompt text."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    max_prompt_tokens: int = 512
    """Longest prompt after the chat template, in tokens."""
    on_bad_row: Literal["error", "skip"] = "error"
    """What a malformed row does: stop loading with an error naming file and row, or be skipped and
    counted."""
    chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template as a user turn."""
    system_prompt: str | None = None
    """System message put before each prompt when the chat template is used."""
    prompt_template: str = "{prompt}"
    """Text sent for each prompt, with '{prompt}' replaced by the dataset's prompt (other braces
    are kept as they are): e.g. a few worked examples before it for a base model."""
    instruction: str = "Put your final answer within \\boxed{}."
    """Appended to each prompt so the reward finds an explicit answer anchor; '' to leave prompts as
    they are."""
    num_arithmetic_problems: int = 2000
    """Problems generated for 'builtin:arithmetic'."""
    arithmetic_max_operand: int = 50
    """Largest operand of a generated arithmetic problem."""
    eval_path: str | None = None
    """Held-out prompts for evaluation (same formats as path); 'builtin:arithmetic' draws a
    disjoint seeded set."""
    eval_size: int = 64
    """Held-out prompts scored before and after training."""
    seed: int = 0
    """Seed of the arithmetic generator."""

    def __post_init__(self) -> None:
        if not self.path:
            self._fail("path", "must name a file, a hub id or builtin:arithmetic")
        for key in ("prompt_field", "answer_field"):
            if not getattr(self, key):
                self._fail(key, "must be a non-empty column name")
        if "{prompt}" not in self.prompt_template:
            self._fail("prompt_template", "must contain '{prompt}'")
        self._positive("max_prompt_tokens", "num_arithmetic_problems", "arithmetic_max_operand")
        self._non_negative("eval_size")


@dataclass(frozen=True)
class RewardConfig(Section):
    _name: ClassVar[str] = "reward"

    name: str = "math"
    """A registered reward ('math') or a dotted path 'package.module:function' to a function
    (completion: str, answer: str) -> float."""
    timeout_s: float = 10.0
    """Hard wall-clock limit for scoring one response; past it the worker is killed and the
    response scores 0."""
    num_workers: int = 2
    """Processes scoring responses in parallel (a pool beside each engine replica's leader)."""
    batch_responses: int = 32
    """Responses sent to a worker as one task. Batching spreads the pool's per-task cost (~0.5 ms
    here) over many cheap rewards; a batch that runs past timeout_s (or whose worker dies) is
    scored again one response per task, so each response still has its own timeout_s."""
    max_answer_chars: int = 1000
    """Longest extracted answer passed to the verifier; longer ones score 0 without parsing."""
    max_abs_reward: float = 1e6
    """Largest |reward| accepted. A reward function that returns more, or anything but a real
    number (a string, a bool, NaN), scores 0 and is counted as a reward error; this keeps the
    group statistics of the advantages finite."""

    def __post_init__(self) -> None:
        if not self.name:
            self._fail("name", "must be a registered name or a dotted path")
        self._positive("timeout_s", "num_workers", "batch_responses", "max_answer_chars",
                       "max_abs_reward")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    _name: ClassVar[str] = "checkpoint"

    save_every_updates: int = 256
    """Save the learner every this many updates (and at each phase end); 0 saves only at phase ends."""
    keep_last: int = 2
    """Learner checkpoints kept in the run directory; older ones are deleted."""
    resume: bool = True
    """Resume from the run directory's last checkpoint and persisted rollouts when there are any."""
    load_from: str | None = None
    """A Megatron checkpoint to start from instead of model.path's HF weights."""
    export_hf: bool = True
    """Export the final policy as a Hugging Face checkpoint to run_dir/hf at the end of the run."""

    def __post_init__(self) -> None:
        self._non_negative("save_every_updates")
        self._positive("keep_last")


@dataclass(frozen=True)
class LoggingConfig(Section):
    _name: ClassVar[str] = "logging"

    run_dir: str = "runs/default"
    """Directory for rollouts, checkpoints, metrics.jsonl, TensorBoard events, report and plots.
    On several nodes it must be one directory on shared storage that every node mounts (every
    rank reads every replica's shards and writes its own checkpoint shards): give an absolute
    path, since a relative one resolves against each node's working directory. Every rank checks
    this at start, before any work."""
    tensorboard: bool = True
    """Write TensorBoard events to run_dir/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases as well (needs the wandb package and a login)."""
    wandb_project: str = "mugrpo"
    """wandb project name."""
    progress: bool = True
    """Show progress bars on the console."""
    eval_every_updates: int = 0
    """Also score the held-out prompts every this many updates (besides before and after the
    run), for accuracy curves. Inside a phase this streams the current weights into the engine
    first: an extra sync that changes nothing of the phase's data (its behaviour log-probs are
    stored) and is not counted in the phase times. 0: only before and after."""

    run_dir_wait_s: float = 30.0
    """At start every rank reads back a token that rank 0 writes into run_dir, to prove that all
    nodes see one directory; a rank waits this long for it to appear (a network file system's
    attribute cache can hide a new file from another node for a while) before the run stops."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            self._fail("run_dir", "must be a directory path")
        self._non_negative("eval_every_updates", "run_dir_wait_s")

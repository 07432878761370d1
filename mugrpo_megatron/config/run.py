"""The run's data, reward, checkpoints and logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from mugrpo_megatron.config.section import Section

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat-message prompt's messages may have."""
MIXTURE_BLOCK = 4096
"""Prompts a mixture with ``data.weights`` lays out at a time (``phase.schedule``): every file's
share is exact to one prompt at each block's end, so none may be below 1 / this."""


@dataclass(frozen=True)
class DataConfig(Section):
    _name: ClassVar[str] = "data"

    path: str | tuple[str, ...] = "builtin:arithmetic"
    """Training prompts: a local .jsonl/.json/.parquet file, a hub dataset id,
    'builtin:arithmetic' for the offline seeded arithmetic task, or a list of them: a mixture
    (verl data.train_files; NeMo-RL data mixtures). Every prompt keeps its source (source_field)
    and the run draws from the files by their weights."""
    weights: tuple[float, ...] | None = None
    """With several paths, each one's share of the prompts drawn over the run (any positive
    numbers, normalised; each at least 1/4096 of them): files are cycled through, each
    reshuffled at every pass over it, so a small file weighted high repeats sooner. null: in
    proportion to their sizes (one shuffle of all their prompts per pass, as one file)."""
    split: str = "train"
    """Split to read from a hub dataset."""
    prompt_field: str = "question"
    """Column holding the prompt: a string, or a list of {role, content} chat messages (verl's
    parquet 'prompt' column, HF chat datasets; verl data.prompt_key, slime --input-key), which go
    through the tokenizer's chat template as given. A dotted path reads a nested field."""
    answer_field: str = "answer"
    """Column holding the reference answer the reward checks against; a dotted path reads a
    nested field, e.g. reward_model.ground_truth (verl's layout; slime --label-key)."""
    source_field: str = "data_source"
    """Column holding each row's source (verl's data_source): what reward.by_source routes on
    and the phase and held-out numbers are split by. A row without it takes its file's stem
    (the hub id's last part; 'arithmetic' for the builtin task)."""
    metadata_fields: tuple[str, ...] = ()
    """Columns (dotted paths allowed) given to a reward function that takes ``metadata``, as a
    dict of their values (JSON), e.g. [extra_info] (verl's extra_info; slime --metadata-key).
    Kept beside each prompt in the run's prompt file (the JSON's bytes a prompt: ~100 MB at
    10^6 prompts of 100 bytes)."""
    max_prompt_tokens: int = 512
    """Longest prompt after the chat template, in tokens."""
    on_bad_row: Literal["error", "skip"] = "error"
    """What a malformed row does: stop loading with an error naming file and row, or be skipped and
    counted."""
    chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template (a string prompt as one user message).
    Message prompts need it."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Options passed to the tokenizer's apply_chat_template, in training, evaluation, the eval
    command and the prompts the rollouts viewer shows alike, e.g. {enable_thinking: false} for
    Qwen3 (verl data.apply_chat_template_kwargs). Part of the run's fingerprint. With
    rollout.tools it gets their JSON schemas as ``tools`` (unless it names its own), so that
    the prompts show the model its tools as its template does."""
    system_prompt: str | None = None
    """System message put before each prompt when the chat template is used (message prompts:
    only where they have no system message)."""
    prompt_template: str = "{prompt}"
    """Text sent for each string prompt, with '{prompt}' replaced by the dataset's prompt (other
    braces are kept as they are): e.g. a few worked examples before it for a base model. Message
    prompts are used as given."""
    instruction: str = "Put your final answer within \\boxed{}."
    """Appended to each prompt (a message prompt's last user message) so the reward finds an
    explicit answer anchor; '' to leave prompts as they are."""
    num_arithmetic_problems: int = 2000
    """Problems generated for 'builtin:arithmetic'."""
    arithmetic_max_operand: int = 50
    """Largest operand of a generated arithmetic problem."""
    eval_path: str | tuple[str, ...] | dict[str, str] | None = None
    """Held-out prompts for evaluation (same formats as path; 'builtin:arithmetic' draws a
    disjoint seeded set): one, a list (each named by its file's stem) or a mapping {name: path}
    of named sets (verl data.val_files), each evaluated and reported on its own."""
    eval_size: int = 64
    """Held-out prompts scored of each set, before and after training (its first ones)."""
    seed: int = 0
    """Seed of the arithmetic generator."""

    def __post_init__(self) -> None:
        if not self.paths or not all(self.paths):
            self._fail("path", "must name a file, a hub id or builtin:arithmetic (or a list)")
        for key in ("prompt_field", "answer_field", "source_field"):
            if not getattr(self, key):
                self._fail(key, "must be a non-empty column name")
        if any(not f for f in self.metadata_fields):
            self._fail("metadata_fields", "must be non-empty column names")
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                self._fail("weights", f"must have one number per data.path ({len(self.paths)})")
            if not all(w > 0 for w in self.weights):
                self._fail("weights", "must all be > 0")
            if min(self.weights) / sum(self.weights) < 1 / MIXTURE_BLOCK:
                self._fail("weights", f"give every file at least 1/{MIXTURE_BLOCK} of the draws")
        if isinstance(self.eval_path, tuple) and not self.eval_path:
            self._fail("eval_path", "must name at least one set (or be null)")
        if "{prompt}" not in self.prompt_template:
            self._fail("prompt_template", "must contain '{prompt}'")
        self._positive("max_prompt_tokens", "num_arithmetic_problems", "arithmetic_max_operand")
        self._non_negative("eval_size")

    @property
    def paths(self) -> tuple[str, ...]:
        """``path`` as a tuple (one item for one path)."""
        return (self.path,) if isinstance(self.path, str) else self.path

    @property
    def eval_sets(self) -> dict[str, str]:
        """The held-out sets by name: a mapping's own names, else each path's stem (made unique
        with its position where two share one); empty without ``eval_path``."""
        if self.eval_path is None:
            return {}
        if isinstance(self.eval_path, dict):
            return dict(self.eval_path)
        paths = (self.eval_path,) if isinstance(self.eval_path, str) else self.eval_path
        names = [source_name(p) for p in paths]
        return {(n if names.count(n) == 1 else f"{n}_{i}"): p
                for i, (n, p) in enumerate(zip(names, paths))}


def source_name(path: str) -> str:
    """The source a file's rows take when they have no source column: its stem ('train' for
    'data/train.parquet', the last part of a hub id, 'arithmetic' for the builtin task)."""
    if path.startswith("builtin:"):
        return path.split(":", 1)[1]
    name = PurePath(path.rstrip("/")).name
    for suffix in (".jsonl", ".json", ".parquet"):
        if name.lower().endswith(suffix):
            return name[:-len(suffix)]
    return name


SERVICE_QUEUE_S = 60.0
"""Seconds a program's request may wait in a SandboxFusion service's queue beyond its run
(``rewards.sandbox_fusion``), and so what the code reward's scoring timeout adds for one."""


@dataclass(frozen=True)
class RewardConfig(Section):
    _name: ClassVar[str] = "reward"

    name: str = "math"
    """A registered reward ('math', 'math_dapo') or a path 'package.module:function' to a
    function (completion: str, answer: str) -> float, which may also take keyword parameters
    ``prompt`` (the prompt as rendered), ``source`` and ``metadata`` (a dict of
    data.metadata_fields): verl's compute_score(data_source, solution_str, ground_truth,
    extra_info) by other names. The signature is read once; a required parameter the scorer
    cannot give is an error before the run starts."""
    by_source: dict[str, str] = field(default_factory=dict)
    """Rewards by source (data.source_field): {source: name or module:function}, as verl routes
    its default_compute_score by data_source; sources not listed use reward.name. Every routed
    function runs under the same timeouts, retries and checks of its return value."""
    timeout_s: float = 10.0
    """Hard wall-clock limit for scoring one response; past it the worker is killed and the
    response scores 0 (a reward failure, counted). With the code reward at least
    sandbox_program_s + 10."""
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
    on_error: Literal["zero", "raise"] = "zero"
    """What a reward function's failure does (it raised, or returned something other than a
    finite number within max_abs_reward). 'zero': the response scores 0, and the failures are
    counted by source and shown with their source, data row and error on the console, in the
    phase line and record, report.md and eval's output. 'raise': the first failure stops the
    run (training: every rank at the phase's end, the shards written so far kept; eval: at
    once), naming its source, row and error. A response that runs past timeout_s scores 0
    either way (counted and shown the same): adversarial completions make verifiers hang. The
    peers have no key for it: verl's naive reward manager and slime's custom reward functions
    (--custom-rm-path) stop on the exception (raise), verl's prime manager scores 0 (zero)."""

    sandbox: str = "bwrap"
    """Where programs a reward runs are run (the code reward; any function that takes
    ``sandbox``). 'bwrap': the OS sandbox, bubblewrap (``rewards/sandbox.py``: no network, a
    read-only view of /usr and the interpreter, a private /tmp, the limits below, the whole
    process tree ended after each run); ``train`` tries it once before any process group and
    refuses, naming the cause, where it cannot start. 'unsafe': the same limits, no isolation,
    said at every start. A URL (http://host:8080, or its /run_code endpoint): a SandboxFusion
    service you run, as verl's reward_model.sandbox_fusion.url (``rewards/sandbox_fusion.py``:
    it applies sandbox_wall_s and sandbox_memory_mb, its own isolation, one request a scoring
    worker, so num_workers is verl's sandbox_fusion.max_concurrent); train runs a program
    there before any process group. verl also runs code in process with resource limits;
    NeMo-RL execs it with restricted builtins."""
    sandbox_python: str | None = None
    """The interpreter programs run with; null: this Python's own installation (not its
    virtualenv: no torch, only the standard library)."""
    sandbox_cpu_s: float = 5.0
    """CPU seconds a program's process may use (RLIMIT_CPU) on one test case."""
    sandbox_wall_s: float = 10.0
    """Wall-clock seconds of one test case, sleeps included; past it the run is ended."""
    sandbox_program_s: float = 30.0
    """Seconds of all of a program's test cases, each case by its own run time (a SandboxFusion
    service's execution_time: the time a case waits in its queue is not counted): a row whose
    cases do not fit is counted as cut short (scored 0 with the timeouts, its reason said).
    reward.timeout_s must be above it."""
    sandbox_memory_mb: int = 1024
    """Address space of each of a program's processes (RLIMIT_AS)."""
    sandbox_processes: int = 32
    """Processes (and threads) a program may have at once (RLIMIT_NPROC)."""
    sandbox_file_mb: int = 16
    """Largest file a program may write, and the size of its private /tmp."""
    sandbox_output_kb: int = 1024
    """Standard output read from a test case; past it the run is ended and the case fails."""
    code_score: Literal["share", "all"] = "share"
    """The code reward's score: the share of the row's test cases passed ('share', verl
    prime_code's continuous score), or 1 only when every case passes ('all')."""

    def __post_init__(self) -> None:
        if not self.name:
            self._fail("name", "must be a registered name or a dotted path")
        url = self.sandbox_is_service
        if self.sandbox not in ("bwrap", "unsafe") and not url:
            self._fail("sandbox", "must be 'bwrap' (the OS sandbox), the http(s) URL of a "
                                  "SandboxFusion service, or 'unsafe' (no isolation)")
        if url and not urlsplit(self.sandbox).netloc:
            self._fail("sandbox", "is not a URL with a host")
        self._positive("sandbox_cpu_s", "sandbox_wall_s", "sandbox_program_s",
                       "sandbox_memory_mb", "sandbox_processes", "sandbox_file_mb",
                       "sandbox_output_kb")
        if self.sandbox_program_s < self.sandbox_wall_s:
            self._fail("sandbox_program_s", f"must be at least reward.sandbox_wall_s "
                                            f"({self.sandbox_wall_s:g}): one case's")
        for source, name in self.by_source.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"reward.by_source.{source}: must be a registered name or a "
                                 f"dotted path, got {name!r}")
        self._positive("timeout_s", "num_workers", "batch_responses", "max_answer_chars",
                       "max_abs_reward")

    @property
    def uses_code(self) -> bool:
        """Whether any route scores with the code reward."""
        return "code" in (self.name, *self.by_source.values())

    @property
    def scoring_timeout_s(self) -> float:
        """The limit on scoring one response: ``timeout_s``, raised to sandbox_program_s + 10
        where the code reward runs (a program's slow cases fail; they are no reward failure),
        and by a minute more where a SandboxFusion service runs them (its queue's waits)."""
        if not self.uses_code:
            return self.timeout_s
        queue = SERVICE_QUEUE_S if self.sandbox_is_service else 0.0
        return max(self.timeout_s, self.sandbox_program_s + 10 + queue)

    @property
    def sandbox_is_service(self) -> bool:
        """Whether ``sandbox`` names a SandboxFusion service (an http(s) URL)."""
        return self.sandbox.startswith(("http://", "https://"))


@dataclass(frozen=True)
class CheckpointConfig(Section):
    _name: ClassVar[str] = "checkpoint"

    save_every_updates: int = 256
    """Save the learner every this many updates, inside a phase or at its end (verl
    trainer.save_freq, slime --save-interval, NeMo-RL checkpointing.save_period count steps
    alike); 0: no such saves. The run's last update is always saved."""
    save_at_phase_end: bool = True
    """Also save at every phase end, so a resume never replays a finished phase's updates. Turn
    it off for schedules of many short phases: GRPO mu = 4 ends a phase every 4 updates, and a
    save at 70B writes ~1 TB (bf16 weights, fp32 master weights and Adam moments), 1024 times a
    run of 4096 updates. Off, a resume starts from the last ``save_every_updates`` save and
    replays the updates since then from the phases on disk (nothing is generated again);
    fixed-length phases only (not with ``algo.max_drift``)."""
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

    def on_interval(self, update: int) -> bool:
        """Whether a checkpoint is due after ``update`` updates by ``save_every_updates``."""
        return bool(self.save_every_updates) and update % self.save_every_updates == 0


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

    eval_samples: Literal["none", "ends", "all"] = "ends"
    """Which held-out evaluations keep their responses, as JSON lines a set in
    run_dir/eval/<updates>_<label>/<set>.jsonl (each: the prompt, the response as the reward saw
    it, its reward, tokens and finish; with tools its turns and calls): 'ends' the run's first
    and last, 'all' every one (``eval_every_updates`` too: at 32k-token responses ~100 MB an
    evaluation of a few hundred prompts x 8), 'none'. verl: trainer.validation_data_dir."""

    run_dir_wait_s: float = 30.0
    """At start every rank reads back a token that rank 0 writes into run_dir, to prove that all
    nodes see one directory; a rank waits this long for it to appear (a network file system's
    attribute cache can hide a new file from another node for a while) before the run stops."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            self._fail("run_dir", "must be a directory path")
        self._non_negative("eval_every_updates", "run_dir_wait_s")


@dataclass(frozen=True)
class EvalConfig(Section):
    _name: ClassVar[str] = "eval"

    samples: int = 1
    """Responses per held-out prompt (verl val_kwargs.n): 1 decodes greedily unless a
    temperature is given; k > 1 samples k, for pass@k and mean@k."""
    samples_by_set: dict[str, int] = field(default_factory=dict)
    """Responses per prompt for named held-out sets that need more than ``samples`` (e.g.
    {aime24: 32} beside MATH-500 at 1); the others take ``samples``."""
    temperature: float | None = None
    """Sampling temperature (verl val_kwargs.temperature); null: greedy at 1 sample,
    rollout.temperature at more."""
    top_p: float = 1.0
    """Nucleus sampling mass (verl val_kwargs.top_p)."""
    max_new_tokens: int | None = None
    """Longest held-out response; null: rollout.max_new_tokens."""
    pass_k: tuple[int, ...] = ()
    """The k of pass@k and mean@k reported for each set with at least k samples a prompt;
    pass@k by the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) from n
    samples with c correct (a reward of at least 1), mean@k the mean reward of k samples (the
    same in expectation for every k: the set's mean reward). (): k = 1 and k = n."""

    def __post_init__(self) -> None:
        self._positive("samples", "top_p")
        if self.top_p > 1:
            self._fail("top_p", "must be in (0, 1]")
        if self.temperature is not None and self.temperature < 0:
            self._fail("temperature", "must be >= 0 (0 decodes greedily) or null")
        if self.max_new_tokens is not None:
            self._positive("max_new_tokens")
        if any(k < 1 for k in self.pass_k):
            self._fail("pass_k", "must be positive integers")
        for name, n in self.samples_by_set.items():
            if not n >= 1:
                raise ValueError(f"eval.samples_by_set.{name}: must be >= 1, got {n!r}")

    def samples_for(self, name: str) -> int:
        """Responses a prompt of held-out set ``name`` gets."""
        return self.samples_by_set.get(name, self.samples)

"""Run configuration: frozen dataclasses, one per concern (``config_loader`` builds them from YAML
with dotted overrides).

Every field has a docstring under it (``python -m mugrpo_megatron config`` prints them).
Loading checks types and rejects unknown keys; each section validates its own values in
``__post_init__``; ``layout.check_layout`` validates the layout for a world size and a model.
All of this runs before any process group exists, and every error names the key and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from mugrpo_megatron.objective import VETO_SCOPES


class _Section:
    """Shared validation helpers; ``_name`` is the section's key in the YAML file."""

    _name: ClassVar[str] = ""

    def _fail(self, key: str, why: str) -> None:
        raise ValueError(f"{self._name}.{key}: {why}, got {getattr(self, key)!r}")

    def _positive(self, *keys: str) -> None:
        for key in keys:
            if not getattr(self, key) > 0:
                self._fail(key, "must be > 0")

    def _non_negative(self, *keys: str) -> None:
        for key in keys:
            if getattr(self, key) < 0:
                self._fail(key, "must be >= 0")


@dataclass(frozen=True)
class ModelConfig(_Section):
    _name: ClassVar[str] = "model"

    path: str = ""
    """Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) to start from."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own Python code to run when loading its tokenizer or config."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter and compute dtype of the learner (fp32 master weights are kept by the optimizer)."""
    fp8_format: Literal["e4m3", "hybrid"] | None = None
    """FP8 training through Transformer Engine: 'e4m3' everywhere, or 'hybrid' (e5m2 gradients).
    None trains without FP8. Needs TE and a GPU with FP8 support (Hopper or newer)."""
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """FP8 scaling recipe passed to megatron-core; 'blockwise' and 'mxfp8' need a recent TE."""
    recompute: Literal["none", "selective", "full"] = "none"
    """What the backward pass recomputes instead of keeping it from the forward pass
    (megatron-core's activation recomputation). 'none': keep every layer's activations
    (fastest). 'selective': recompute core attention: saves its seq^2 scores where attention is
    not a flash kernel (CPU); with Transformer Engine's flash attention (GPUs) it saves nothing
    and costs a little. 'full': keep only each layer's input and recompute the layer in the
    backward pass: ~2 bytes x tokens x hidden a layer instead of ~34 (divided by TP with
    sequence parallel), for about a third more compute per update. ``train --dry-run``
    estimates the optimizer's memory with each and names the cheapest that fits."""

    def __post_init__(self) -> None:
        if self.fp8_format is not None and self.dtype == "float32":
            self._fail("dtype", "FP8 training needs dtype bfloat16 or float16")


@dataclass(frozen=True)
class ParallelConfig(_Section):
    _name: ClassVar[str] = "parallel"

    tensor: int = 1
    """Tensor-parallel size of the learner."""
    pipeline: int = 1
    """Pipeline-parallel size of the learner."""
    virtual_pipeline: int | None = None
    """Model chunks per pipeline stage (interleaved schedule); None for no virtual pipeline."""
    expert: int = 1
    """Expert-parallel size (MoE models only)."""
    sequence_parallel: bool = False
    """Shard layer-norm and dropout activations along the sequence over the TP group (needs TP > 1)."""
    distributed_optimizer: bool = True
    """Shard optimizer state and fp32 master weights over data-parallel ranks (ZeRO-1)."""
    micro_batch_size: int = 1
    """Responses per microbatch on each data-parallel rank."""
    pack_tokens: int | Literal["auto"] = "auto"
    """Pack whole sequences (prompt + response) end to end into microbatch rows of this many
    tokens (first fit, longest first; rounded up as pad_tokens_to says) instead of padding every
    row to the batch's longest; each microbatch is one such row. 0 pads. 'auto': on a GPU with
    Transformer Engine, rows of micro_batch_size x (data.max_prompt_tokens +
    rollout.max_new_tokens), as many tokens as the largest padded microbatch (same activation
    memory), through TE's THD attention (sequences kept apart by cu_seqlens); elsewhere 0, since
    megatron's local attention keeps packed sequences apart with a T x T mask. Saves the padding
    (over half of the tokens with heavy-tailed response lengths: benchmarks/RESULTS.md); costs a
    first-fit pass over a rank's rows per update. The first mismatch check of a run scores rows
    both ways and stops the run if they differ."""
    pad_tokens_to: int = 0
    """Pad each microbatch row (or size each packed row) so that every tensor-parallel rank's
    share of its tokens is a multiple of this. 0: what FP8 needs with model.fp8_format (16 for
    the delayed and tensorwise recipes, 32 for mxfp8, 128 for blockwise: Transformer Engine's
    GEMMs refuse other shapes), else 1. The padding is no response token: no loss or log-prob
    changes; it costs at most this many tokens (x tensor with sequence parallel) a row."""
    timeout_minutes: float = 180.0
    """Collective timeout, for every process group of the job: torch's default group, megatron's
    TP/PP/DP/EP groups (and the gloo groups it makes) and the engines' groups. A rank without an
    engine, and a replica that finishes its share of a phase first, wait for the slowest replica
    in a collective, so this must exceed the longest generation stage (and evaluation) of the
    run; a rank that froze or died is noticed after this long, with an error that names this
    key."""
    offload_learner: Literal["auto", "always", "never"] = "auto"
    """Move the learner's weights, gradients and optimizer state to host memory while the engine
    generates (and evaluates), and back before the next update. 'auto': on when the learner is on
    a GPU; 'always' also on CPU (useful only to test it)."""

    def __post_init__(self) -> None:
        self._positive("tensor", "pipeline", "expert", "micro_batch_size", "timeout_minutes")
        if self.virtual_pipeline is not None:
            if self.virtual_pipeline < 2:
                self._fail("virtual_pipeline", "must be >= 2 or null")
            if self.pipeline < 2:
                self._fail("virtual_pipeline", "needs parallel.pipeline >= 2")
        if self.sequence_parallel and self.tensor == 1:
            self._fail("sequence_parallel", "needs parallel.tensor > 1")
        if self.pack_tokens != "auto" and self.pack_tokens < 0:
            self._fail("pack_tokens", "must be >= 0 (0: pad instead of packing) or auto")
        self._non_negative("pad_tokens_to")

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` processes; ValueError if it does not divide."""
        model_parallel = self.tensor * self.pipeline
        if world_size < 1 or world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor x parallel.pipeline "
                f"= {self.tensor} x {self.pipeline} = {model_parallel}"
            )
        dp = world_size // model_parallel
        if dp % self.expert:
            raise ValueError(f"parallel.expert: {self.expert} must divide the data-parallel size {dp}")
        return dp


@dataclass(frozen=True)
class RolloutConfig(_Section):
    _name: ClassVar[str] = "rollout"

    engine: Literal["vllm", "sglang"] = "vllm"
    """Rollout engine, imported only when chosen. SGLang needs an environment of its own (it pins
    its own torch): scripts/setup_sglang_env.sh."""
    tensor_parallel: int = 1
    """Tensor-parallel size of each engine replica (independent of the learner's layout)."""
    placement: Literal["auto", "spmd", "node", "rank0"] = "auto"
    """Where the engine runs. 'spmd' (vLLM): every torchrun rank hosts one tensor-parallel rank of
    an engine, so world size / rollout.tensor_parallel replicas each generate a share of the
    prompts (vLLM's external launcher), and every replica takes the weights in-process from the
    learner on its own ranks. 'node' (SGLang): one engine per node, started by the node's first
    rank with rollout.tensor_parallel of its GPUs; each takes every weight from the learner ranks
    of its own process. 'rank0': one engine started by global rank 0 (vLLM then needs
    rollout.tensor_parallel = 1). 'auto': spmd for vLLM, node for SGLang."""
    group_size: int = 8
    """G: responses sampled per prompt; advantages are normalised within each group."""
    max_new_tokens: int = 512
    """Longest response, in tokens; longer ones stop with finish reason 'length'."""
    temperature: float = 1.0
    """Sampling temperature (1.0 samples the policy itself, which the ratios assume)."""
    top_p: float = 1.0
    """Nucleus sampling mass; below 1.0 the behaviour log-probs are not the policy's."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory the engine may take for weights and KV cache (GPU only)."""
    cpu_kv_cache_gib: float = 1.0
    """KV-cache size in GiB when the engine runs on CPU."""
    sleep_between_phases: bool = True
    """Release the engine's GPU memory (weights and KV cache) while the learner optimizes."""
    weight_bucket_mb: int = 512
    """Size of one bucket of weights streamed from the learner to the engine, in MiB."""
    shard_prompts: int = 64
    """Groups (prompts, each with its G responses) per rollout shard. A replica's leader scores
    finished groups and writes them to the run directory a shard at a time, so a kill loses at
    most the groups in the engine plus about one shard per replica. Larger shards: fewer files
    (each open shard holds a file descriptor on every rank; 10^6 responses at G = 8 and 256
    prompts a shard is ~490 files)."""
    max_num_seqs: int = 0
    """Sequences an engine replica runs at once at most (each of a group's G responses is one):
    vLLM's max_num_seqs, SGLang's max_running_requests. 0: the engine's default (vLLM 0.32: 1024
    on H100/H200, 256 on smaller GPUs, 256 x TP on CPU)."""
    max_inflight_prompts: int = 0
    """Prompts each replica keeps queued in its engine while it streams its share of a phase
    (each finished group is replaced by the next prompt). 0: twice what the engine runs at once,
    ceil(2 x its max_num_seqs / G): the running batch stays full with as many waiting to take a
    finished group's place, and a share of 1.25 x 10^5 requests (10^6 responses, 8 replicas) is
    not held in the scheduler as Python objects. SGLang has no step API here: it takes windows
    of this many (0: rollout.shard_prompts), each waiting for its slowest response."""
    eval_samples: int = 1
    """Responses per held-out prompt in evaluation (k of mean@k and pass@k); 1 decodes greedily."""
    mismatch_check_samples: int = 4
    """Engine samples re-scored by the learner after each weight sync (train/infer log-prob gap);
    0 turns the check off."""
    seed: int = 0
    """Sampling seed of the engine."""

    def __post_init__(self) -> None:
        self._positive("tensor_parallel", "group_size", "max_new_tokens", "cpu_kv_cache_gib",
                       "weight_bucket_mb", "shard_prompts", "eval_samples")
        self._non_negative("mismatch_check_samples", "max_inflight_prompts", "max_num_seqs")
        if not 0 < self.temperature:
            self._fail("temperature", "must be > 0")
        if not 0 < self.top_p <= 1:
            self._fail("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            self._fail("top_k", "must be -1 (off) or >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            self._fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.placement == "spmd" and self.engine != "vllm":
            self._fail("placement", f"spmd needs vLLM's external launcher; {self.engine} runs as "
                                    f"one engine per node or on rank 0 (placement: node, rank0 "
                                    f"or auto)")
        if self.placement == "node" and self.engine != "sglang":
            self._fail("placement", "node is for SGLang (its engine runs its own processes); "
                                    "vLLM's replicas per node are placement spmd")
        if self.spmd is False and self.engine == "vllm" and self.tensor_parallel > 1:
            self._fail("placement", f"rank0 with vLLM needs rollout.tensor_parallel = 1 (got "
                                    f"{self.tensor_parallel}): vLLM would run its other "
                                    f"tensor-parallel ranks in processes of its own, which the "
                                    f"weight stream cannot reach; use placement: spmd (or auto)")

    @property
    def spmd(self) -> bool:
        """Whether every rank hosts an engine rank (``placement``, with 'auto' resolved)."""
        return self.engine == "vllm" and self.placement in ("auto", "spmd")

    @property
    def per_node(self) -> bool:
        """Whether each node's first rank starts an engine (``placement`` node, or auto with SGLang)."""
        return self.engine == "sglang" and self.placement in ("auto", "node")


@dataclass(frozen=True)
class AlgoConfig(_Section):
    _name: ClassVar[str] = "algo"

    total_updates: int = 4096
    """Optimizer updates in the whole run (the paper uses 4096 for both GRPO and Mu-GRPO)."""
    updates_per_phase: int = 1024
    """mu: optimizer updates per rollout refresh. 4 is standard GRPO; 1024 is Mu-GRPO's 4 phases."""
    prompts_per_phase: int = 1024
    """Prompts whose G responses are generated at the start of each phase."""
    samples_per_update: int = 256
    """Responses in one optimizer update (the minibatch), over all data-parallel ranks."""
    clip_low: float = 1.0
    """eps_low: the ratio is clipped below at 1 - clip_low (1.0 = no lower clip, as in [0, 5])."""
    clip_high: float = 4.0
    """eps_high: the ratio is clipped above at 1 + clip_high (4.0 = the paper's relaxed [0, 5])."""
    veto_threshold: float | None = 1e-4
    """Negative-advantage veto: a token of an A < 0 response whose ratio falls below this triggers
    it. null disables the veto."""
    veto_scope: Literal["none", "trigger", "suffix", "suffix_no_trigger", "sequence"] = "suffix"
    """Tokens removed once a veto triggers: 'suffix' is the paper's S_kappa (after the first trigger)."""
    adv_eps: float = 1e-6
    """eps in A = (r - mean) / (std + eps)."""
    uniform_groups: Literal["keep", "drop", "drop_once"] = "keep"
    """Groups whose G responses all got the same reward (A = 0 on every token). 'keep': trained
    on like any sample, each once a pass; they add nothing to the gradient but count in the token
    mean, which shrinks the step by their share (GRPO in TRL and verl). 'drop': left out, and the
    mu updates of samples_per_update draw from the rest, so each remaining sample is trained on
    1 / (1 - uniform fraction) times as often: staler than the paper's. 'drop_once': left out,
    and each update takes the rest / mu (a multiple of DP x micro_batch_size): one pass, smaller
    and noisier updates, nothing reused. Uniform groups are counted and logged either way, with
    the passes each phase made."""
    behaviour_logprobs: Literal["engine", "learner"] = "engine"
    """The behaviour policy's log-probs the ratios divide by. 'engine': the engine's, as it
    sampled (the paper's bypass; no extra pass). 'learner': the learner scores every response of
    a phase once, before its first update, with the weights the engine sampled from, and keeps
    them beside the engine's (rollouts/phase_N/behaviour_learner.arrow): one forward pass over
    the phase's tokens, about a third of a training pass over them. On GPUs in bf16, or with an
    FP8 engine, the two differ by 1e-3 or more a token, which moves ratios near the veto's
    trigger; the phase log has that gap over every token, and the seconds the pass took."""
    seed: int = 1234
    """Seed for prompt order, minibatch shuffling and the learner's initialisation."""

    def __post_init__(self) -> None:
        self._positive("total_updates", "updates_per_phase", "prompts_per_phase",
                       "samples_per_update", "adv_eps")
        if self.total_updates % self.updates_per_phase:
            self._fail("total_updates", f"must be a multiple of algo.updates_per_phase "
                                        f"({self.updates_per_phase})")
        if not 0 <= self.clip_low <= 1:
            self._fail("clip_low", "must be in [0, 1] (the lower ratio bound 1 - clip_low >= 0)")
        self._non_negative("clip_high")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            self._fail("veto_threshold", "must be in (0, 1) or null")
        if self.veto_scope not in VETO_SCOPES:  # the Literal above, for direct construction too
            self._fail("veto_scope", f"must be one of {list(VETO_SCOPES)}")

    @property
    def num_phases(self) -> int:
        return self.total_updates // self.updates_per_phase


@dataclass(frozen=True)
class OptimConfig(_Section):
    _name: ClassVar[str] = "optim"

    lr: float = 1e-6
    """Peak learning rate of Adam."""
    min_lr: float = 0.0
    """Learning rate at the end of a decaying schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over algo.total_updates."""
    warmup_updates: int = 0
    """Linear warm-up from 0 over this many updates."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        self._positive("lr", "adam_eps")
        self._non_negative("min_lr", "warmup_updates", "weight_decay", "grad_clip")
        if self.min_lr > self.lr:
            self._fail("min_lr", f"must be <= optim.lr ({self.lr})")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                self._fail(key, "must be in [0, 1)")


@dataclass(frozen=True)
class DataConfig(_Section):
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
class RewardConfig(_Section):
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
class CheckpointConfig(_Section):
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
class LoggingConfig(_Section):
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


@dataclass(frozen=True)
class Config:
    """A whole run: one object, built from YAML, validated before any process group exists."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The learner's parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine and its sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Mu-GRPO: schedule, clipping, veto."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, resuming and exporting."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where and how progress is reported."""

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a phase can hold: the longest prompt and the longest response."""
        return self.data.max_prompt_tokens + self.rollout.max_new_tokens

    def __post_init__(self) -> None:
        pack = self.parallel.pack_tokens
        if pack != "auto" and 0 < pack < self.max_sequence_tokens:
            raise ValueError(f"parallel.pack_tokens: {pack} tokens cannot hold the longest "
                             f"sequence, data.max_prompt_tokens + rollout.max_new_tokens = "
                             f"{self.max_sequence_tokens}; raise it, or 0 to pad")
        samples_per_phase = self.algo.prompts_per_phase * self.rollout.group_size
        if self.algo.samples_per_update > samples_per_phase:
            raise ValueError(
                f"algo.samples_per_update: {self.algo.samples_per_update} is more than a phase "
                f"generates (algo.prompts_per_phase x rollout.group_size = {samples_per_phase})"
            )

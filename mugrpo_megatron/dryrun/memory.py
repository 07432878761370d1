"""The dry run's memory model: per-GPU memory at every transition of a phase, and host memory per
node, as arithmetic on the architecture (the checkpoint's ``config.json``). No GPU, no megatron.

What one rank holds:

- learner state: this rank's parameters (TP x PP split; the first and last stages also hold the
  padded embedding and output layer) in the training dtype; gradients in fp32 (megatron DDP's
  ``grad_reduce_in_fp32``); fp32 master weights and Adam's two moments (12 bytes a parameter,
  8 in fp32 training), divided by DP with the distributed optimizer. ``parallel.offload_learner``
  moves it to host memory before the engine wakes for a sync and through the generation after
  it (``learner.offload``: gradient buffers freed, weights and optimizer state copied); the sync
  streams from that host copy, one parameter on the device at a time.
- activations: Korthikanti et al. (2022), 34*s*b*h bytes per layer and microbatch (s*b: the
  tokens of the largest microbatch, a packed row where the learner packs), divided by TP
  with sequence parallel (10 of the 34 stay replicated without it), with flash attention (no
  s^2 term, so selective recomputation, which recomputes only that part, saves nothing); with
  full recomputation each layer keeps its input, 2*s*b*h (divided by TP with sequence parallel),
  and one layer's activations exist at a time in the backward pass; the first pipeline stage
  holds up to PP microbatches in flight under 1F1B.
- logits (``logits_bytes``): a microbatch's vocabulary shard in fp32, which the log-probs work on
  in place and keep as the softmax for the backward pass (4 bytes a logit), beside the output
  layer's own output and megatron's transposed copy of it (2 x the model dtype) while one is
  made from the other; at a temperature other than 1, with an entropy bonus, or both, one fp32
  copy more (4). Checked on CPU against the allocator's peak in an update
  (``tests/test_memory.py``).
- what no offload frees (``resident``): the CUDA context and library workspaces; NCCL's buffers,
  per communicator the rank uses (``communicators``: counted on CPU by recording the groups
  every collective of an update, a scoring pass and a weight sync goes over); with FP8,
  Transformer Engine's FP8 copy of every GEMM weight and its transpose (2 bytes a GEMM
  parameter, kept between steps).
- the engine (vLLM 0.32-0.33, sleep mode with the cumem allocator; read in
  ``device_allocator/cumem.py``, ``sleep_mode_backend.py`` and ``v1/worker/gpu_worker.py``):
  awake, its budget (``rollout.gpu_memory_utilization`` of the GPU: weights at the engine's TP
  size, KV cache, CUDA graphs) plus its runtime and workspace pools; asleep (level 2, as
  ``engines.vllm_engine`` sleeps), nothing on the device: the runtime and CUDA-graph pools (and
  the model's buffers: rotary caches, a few MB) are backed up to pinned host memory, the
  weights, KV cache and workspaces dropped (level 1 would back the weights up too: ~17.5 GB a
  GPU at 70B TP 8, each way, for the sync to overwrite); woken for a sync (tags ['weights']),
  the weights' memory (then written by the sync) and every pool that is not deferrable
  (runtime, CUDA graphs, workspaces) come back, not the KV cache.
- the reference policy (``algo.kl_coef`` > 0 with ``kl_target: reference``): this rank's shards
  of its weights in pinned host memory (chunked as the learner's offload); once a phase, after
  generation, swapped into the learner's weight storages for a no-grad pass over the phase's
  tokens (``reference``: the weights, one microbatch's forward, its logits), the learner's own
  weights in host memory meanwhile (offloaded for the generation anyway); ``reference_seconds``
  is that pass's compute at ``ASSUMED_MFU`` of ``DATASHEET_BF16`` on every GPU.
- a weight sync's stream (``stream_bytes``): one bucket in flight (twice across pipeline stages:
  the owner's tensors and the broadcast buffer), or the largest tensor, which travels alone
  (the vocabulary); and what vLLM's layer-wise reload keeps (``reload_bytes``): every tensor of
  the module being loaded until the module is complete, as full HF tensors (a fused MoE layer's
  experts: 128 x 3 x 2048 x 768 bf16 = 1.2 GB at Qwen3-30B-A3B), and a new copy of the module's
  shard that they are loaded into; the vocabulary's layers until the stream ends when vLLM
  pads the vocabulary. Checked on CPU against the allocator's peak while the stream is drained,
  and the streamed tensors an engine update holds at once.

Host memory per node (``host_bytes``), pinned: torch's caching host allocator rounds every
pinned allocation up to a power of two (torch 2.13/2.14 ``CachingHostAllocator::allocate``),
so the learner's offload lays its state across chunks of one power-of-two size
(``learner.offload.HOST_CHUNK``: less than one chunk wasted a rank), while vLLM's sleep backs
up each allocation on its own: each pool (and at level 1 each weight tensor) rounded up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mugrpo_megatron.config import Config
from mugrpo_megatron.layout import context_comm_type, pack_capacity, packs_with, token_multiple
from mugrpo_megatron.layout.shapes import ENGINE_FP8_BLOCK, engine_slices_problem
from mugrpo_megatron.models.hf_config import ModelSpec

GIB = 1 << 30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
H100_GIB = 79.6
"""What CUDA reports of an 80 GB H100 (81,559 MiB): the default --gpu-gib."""
CUDA_CONTEXT = 1.0 * GIB
GROUPED_GEMM_WORKSPACE = 4 * (32 * 2**20 + 1024)
"""Transformer Engine's grouped GEMM (an MoE's experts, TEGroupedMLP): a cuBLAS workspace for
each of its 4 compute streams, 32 MiB + 1 KiB each on Hopper (TE 2.11
``cpp_extensions/gemm.py`` ``get_cublas_workspace``, ``common/util/multi_stream.cpp``), made
once a process and never freed."""
"""CUDA context, cuBLAS/cuDNN and Transformer Engine workspaces of one process (~0.5-1 GiB)."""
NCCL_PER_COMMUNICATOR = 0.5 * GIB
"""NCCL buffers of one communicator: NCCL_BUFFSIZE (4 MiB) per channel and peer for the Simple
protocol, plus LL/LL128, on up to 32 channels; NVLS (NVSwitch systems) adds more per communicator
(NCCL_NVLS_ENABLE=0 turns it off). Allocated when a communicator runs its first collective."""
VLLM_GRAPH_POOL = 2.0 * GIB
"""vLLM's CUDA-graph pool (captured batch sizes up to 512): inside its budget while it runs,
backed up to the host while it sleeps, woken with the weights."""
VLLM_RUNTIME = 0.5 * GIB
"""vLLM's runtime pool (its KV-cache initialisation state) and dense workspaces, woken with the
weights (a MoE model adds ``moe_workspace``)."""
VLLM_BATCHED_TOKENS = 8192
"""Tokens vLLM schedules in one step at most (max_num_batched_tokens' default): what its fused
MoE workspaces are sized by."""
VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of this (``DEFAULT_VOCAB_PADDING_SIZE``, 0.32-0.33)."""
HOST_CHUNK = 1 << 28
"""The learner's pinned host chunk (``learner.offload.HOST_CHUNK``; the same number, kept here
so the dry run imports nothing from the learner)."""
MARGIN = 0.05
"""Fraction of the GPU the largest transition must leave free."""
TRANSITIONS = ("start", "sync", "generate", "evaluate", "reference", "optimize", "save")
"""The phase's transitions ('reference' only with a KL term to a reference policy)."""
DATASHEET_BF16 = 989e12
"""H100 SXM dense bf16 FLOP/s (NVIDIA's datasheet): the reference pass's time is read from it."""
ASSUMED_MFU = 0.4
"""The model FLOPs utilisation a no-grad forward over packed rows is taken to reach (stated, not
measured: no GPU has run it here)."""
RECOMPUTE_COST = {"none": "fastest", "selective": "+ core attention's forward",
                  "full": "~1/3 more compute an update"}
"""``model.recompute``'s choices, cheapest first, with what each adds to an update."""


def pinned(nbytes: float) -> int:
    """What torch's caching host allocator gives a pinned allocation of ``nbytes``: the next
    power of two."""
    return 1 << max(0, math.ceil(math.log2(max(nbytes, 1))))


def microbatch_tokens(cfg: Config, spec: ModelSpec) -> tuple[int, str]:
    """Tokens of the largest microbatch on a GPU (Transformer Engine installed, as the GPU
    install has it), and how they are laid out: a packed row (``parallel.pack_tokens``: 'auto'
    packs there, into rows of micro_batch_size x the longest sequence), or micro_batch_size rows
    padded to the longest sequence; under context parallelism a CP rank's share of either."""
    p = cfg.parallel
    packed = pack_capacity(p, cfg.max_sequence_tokens, thd=True,
                           multiple=token_multiple(cfg.model, p),
                           exchange_packs=packs_with(context_comm_type(spec, p)))
    if packed:
        cp = (f", each CP rank holding 2 of the {2 * p.context} chunks of every sequence in it "
              f"(each padded to a multiple of {2 * p.context})") if p.context > 1 else ""
        return packed // p.context, \
            f"packed rows of {packed} tokens (THD through Transformer Engine){cp}"
    cp = f", each CP rank holding 2 of its {2 * p.context} chunks" if p.context > 1 else ""
    return p.micro_batch_size * cfg.max_sequence_tokens // p.context, \
        f"{p.micro_batch_size} row(s) padded to the rank's longest (up to " \
        f"{cfg.max_sequence_tokens}){cp}"


def cp_ring_bytes(cfg: Config, spec: ModelSpec) -> float:
    """Transformer Engine's context-parallel attention (``cp_comm_type`` p2p) passes K and V
    around the CP ring a chunk pair at a time, receiving the next while it attends to the one
    in hand: two receive buffers of a CP rank's K and V, in the model dtype, for the layer
    running (the backward passes the gradients of K and V around likewise)."""
    p = cfg.parallel
    if p.context == 1:
        return 0.0
    tokens = microbatch_tokens(cfg, spec)[0]
    kv = 2 * tokens * spec.num_kv_heads / p.tensor * spec.head_dim * BYTES[cfg.model.dtype]
    return 2 * kv * 2  # two buffers; forward's K, V and backward's dK, dV at the peak


def full_layer_bytes(cfg: Config, spec: ModelSpec, tokens: int) -> float:
    """One layer's activations for ``tokens`` tokens (Korthikanti et al.), as TP and sequence
    parallel split them."""
    p, h, tp = cfg.parallel, spec.hidden_size, cfg.parallel.tensor
    return tokens * h * (34 / tp if p.sequence_parallel or tp == 1 else 24 / tp + 10)


def activation_bytes(cfg: Config, spec: ModelSpec, dp: int, recompute: str) -> tuple[float, int]:
    """Activation memory of the first pipeline stage during an update with ``recompute``, and the
    microbatches it holds in flight (1F1B: up to PP)."""
    p = cfg.parallel
    tokens = microbatch_tokens(cfg, spec)[0]  # s x b of the formulas
    h, tp = spec.hidden_size, p.tensor
    layers_stage = spec.num_layers / p.pipeline
    in_flight = min(p.pipeline, max(1, cfg.algo.samples_per_update // (dp * p.micro_batch_size)))
    full_layer = full_layer_bytes(cfg, spec, tokens)
    if recompute == "full":  # the layers' inputs of every microbatch in flight, one layer's all
        inputs = 2 * tokens * h / (tp if p.sequence_parallel else 1) * layers_stage
        return inputs * in_flight + full_layer, in_flight
    return full_layer * layers_stage * in_flight, in_flight  # selective: no s^2 term to drop


def logits_bytes(tokens: int, vocab_rows: int, dtype: str, temperature: float,
                 entropy_grad: bool = False) -> float:
    """A microbatch's logits at their peak (see the module docstring). A temperature other
    than 1, an entropy bonus (``algo.entropy_coef``: its backward's saved fp32 copy, which the
    gradient then overwrites) or both add one fp32 copy at the peak: measured on CPU, either
    alone or both together peak at the same bytes a logit (``tests/test_memory.py``). Before
    the entropy's gradient was written into its saved copy, both together peaked at 28.5
    bytes a logit in fp32 (20 counted; 16.5 now)."""
    per_logit = 4 + 2 * BYTES[dtype] + (4 if temperature != 1.0 or entropy_grad else 0)
    return float(tokens) * vocab_rows * per_logit


def communicators(cfg: Config, dp: int) -> dict[str, int]:
    """The NCCL communicators a rank runs collectives on, by what they serve: the world group
    (the learner's metric and log-prob reductions, our agreements), TP, DP and its
    context-parallel twin (megatron keeps both, with the same ranks), TP x DP and its twin (FP8's
    amax reduction, the optimizer's), one over every rank of the model (megatron's gradient-norm
    group), PP and a point-to-point one with each pipeline neighbour, the embedding group, EP,
    expert DP and expert TP x DP; the CP group (TE's K/V ring, the loss's reductions of whole
    responses); the engine's world and tensor-parallel groups; a sync that sends each engine
    rank its slices of the experts (``learner.engine_slices``) batches its sends in megatron's
    expert TP x EP group (one communicator: torch runs a batch of point-to-point ops on its
    group's). Counted from what megatron-core 0.16 issues over gloo in scaled-down layouts
    (tests/test_collectives.py checks this against them)."""
    p = cfg.parallel
    r = cfg.rollout
    slices = r.spmd and r.tensor_parallel > p.tensor and r.tensor_parallel % p.tensor == 0
    fp8 = cfg.model.fp8_format is not None
    dpcp = dp * p.context  # context parallel: gradients and optimizer over DP x CP, and its group
    out = {"world": 1, "tensor": int(p.tensor > 1), "data": 2 * (dpcp > 1),
           "tensor x data": 2 * (dpcp > 1 and (p.tensor > 1 or fp8 or p.expert > 1)),
           "model": int(dpcp > 1 or p.pipeline > 1),
           "pipeline": 3 * (p.pipeline > 1), "embedding": int(p.pipeline > 1),
           "expert": 3 * (p.expert > 1), "context": int(p.context > 1),
           "engine slices": int(slices and p.expert > 1),
           "engine": 1 + (cfg.rollout.tensor_parallel > 1)}
    return {k: v for k, v in out.items() if v}


@dataclass(frozen=True)
class EngineTensors:
    """The engine's weights as it holds them at its TP size: each tensor's bytes (vLLM fuses
    q/k/v, gate/up and each layer's experts; shards all but norms and the router). With
    ``fp8`` (``rollout.quantization``) the linear weights of the layers take a byte an element
    and a float32 scale a 128 x 128 block; the vocabulary, norms and router keep ``dtype``."""

    sizes: tuple[float, ...]

    @classmethod
    def of(cls, spec: ModelSpec, tp: int, dtype: str, fp8: bool = False) -> EngineTensors:
        w, h = BYTES[dtype], spec.hidden_size
        linear_w = 1 + 4 / math.prod(ENGINE_FP8_BLOCK) if fp8 else w  # and a float32 scale
        vocab = math.ceil(spec.vocab_size / (64 * tp)) * 64  # VocabParallelEmbedding's padding
        attention = [(n, linear_w) for _, n in spec.attention_tensors(tp)] + [(h, w), (h, w)]
        if spec.mla is not None:  # the latents' norms
            attention += [(spec.attention_norms(), w)]
        dense = [(2 * spec.ffn_hidden_size * h / tp, linear_w),
                 (h * spec.ffn_hidden_size / tp, linear_w)]
        sizes = [(vocab * h, w)]
        for layer in range(spec.num_layers):
            sizes += attention
            if spec.is_moe_layer(layer):
                i, shared = spec.moe_ffn_hidden_size, spec.shared_ffn_hidden_size
                sizes += [(spec.num_experts * 2 * i * h / tp, linear_w),
                          (spec.num_experts * h * i / tp, linear_w),
                          (spec.num_experts * h, w)]  # w13, w2, router
                if shared:
                    sizes += [(2 * shared * h / tp, linear_w), (h * shared / tp, linear_w)]
            else:
                sizes += dense
        sizes.append((h, w))
        if not spec.tie_embeddings:
            sizes.append((vocab * h, w))
        return cls(tuple(n * b for n, b in sizes))

    @property
    def total(self) -> float:
        return sum(self.sizes)

    @property
    def pinned(self) -> int:
        """Host memory its sleep's backups take: each rounded up to a power of two."""
        return sum(pinned(n) for n in self.sizes)


def moe_workspace(spec: ModelSpec, tp: int, dtype: str) -> float:
    """vLLM's fused-MoE workspaces for a step of ``VLLM_BATCHED_TOKENS`` tokens: the routed
    tokens' gate/up output and activation, and the down projection's output (intermediate caches
    1-3 of ``fused_moe``)."""
    if not spec.is_moe:
        return 0.0
    routed = VLLM_BATCHED_TOKENS * spec.experts_per_token
    i = spec.moe_ffn_hidden_size / tp
    return routed * (2 * i + i + spec.hidden_size) * BYTES[dtype]


def stream_bytes(spec: ModelSpec, tp: int, pp: int, bucket: int, dtype: str) -> float:
    """A weight sync's stream on one rank (``learner.export.iter_hf_tensors``): the largest tensor
    it hands out (the vocabulary, gathered whole: its padded rows at TP > 1), or a bucket, twice
    across pipeline stages (the owner's tensors and the broadcast's flat buffer)."""
    rows = spec.padded_vocab_size(tp) if tp > 1 else spec.vocab_size
    largest = rows * spec.hidden_size * BYTES[dtype]
    return max(largest, 2 * bucket if pp > 1 else 0)


def reload_held(spec: ModelSpec, dtype: str, fp8: bool = False) -> tuple[float, float]:
    """The streamed tensors vLLM's layer-wise reload holds at most (0.32-0.33,
    ``reload/layerwise.py``), as (the largest module's, the vocabulary's): a module's tensors
    wait, as the full HF tensors the sync sends, until every element of the module is loaded:
    a MoE layer's experts, else gate and up or q, k and v. A vocabulary that is not a multiple
    of 64 (vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``) leaves its padded rows unloaded, so the
    embedding and the output layer wait for ``finalize_layerwise_reload`` at the stream's end.
    With ``fp8`` a module's streamed tensors are its e4m3 weights (a byte an element)."""
    h, w = spec.hidden_size, BYTES[dtype]
    qkv = max(n for _, n in spec.attention_tensors(1))
    mlp = (spec.num_experts * 3 * spec.moe_ffn_hidden_size * h if spec.is_moe
           else 2 * spec.ffn_hidden_size * h)
    vocab_waits = spec.vocab_size % VLLM_VOCAB_PADDING != 0
    vocab = spec.vocab_size * h * (1 if spec.tie_embeddings else 2) if vocab_waits else 0
    return max(qkv, mlp) * (1 if fp8 else w), vocab * w


def reload_bytes(spec: ModelSpec, engine_tp: int, dtype: str, fp8: bool = False) -> float:
    """What vLLM's layer-wise reload holds beside the engine's weights: the streamed tensors of
    ``reload_held``, and the module being loaded materialized anew (its shard, a second copy
    beside the one in place until the loaded values are copied over)."""
    module, vocab = reload_held(spec, dtype, fp8)
    return module * (1 + 1 / engine_tp) + vocab


def sync_bytes(cfg: Config, spec: ModelSpec, total: float, stage_ranks: int
               ) -> tuple[str, float]:
    """(how the stream is cut, the bytes one rank receives a sync), as
    ``learner.export.iter_hf_tensors`` sends them: 'whole' (every tensor), or, where vLLM runs
    spmd at a TP that is the learner's ('own shards': ``handoff.sync_engine_tp``) or a multiple
    of it ('engine slices': ``learner.engine_slices``, where ``engine_slices_problem`` allows),
    the projections and the experts' slices at 1/(engine TP) and the vocabulary, norms and
    routers whole."""
    tp, engine_tp, w = cfg.parallel.tensor, cfg.rollout.tensor_parallel, BYTES[cfg.model.dtype]
    if not (cfg.rollout.spmd and engine_tp > 1 and engine_tp % tp == 0):
        return "whole", total * w
    how = "own shards" if engine_tp == tp else "engine slices"
    if how == "engine slices" and engine_slices_problem(spec, tp, engine_tp, stage_ranks):
        return "whole", total * w
    whole = spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2)
    return how, (whole + (total - whole) / engine_tp) * w


def estimate(cfg: Config, spec: ModelSpec, dp: int, gpu_gib: float = H100_GIB,
             ranks_per_node: int = 8) -> dict:
    """Every item and transition of the module docstring, in bytes, for a job of ``dp``
    data-parallel ranks (the layout already checked) on GPUs of ``gpu_gib``."""
    p, r = cfg.parallel, cfg.rollout
    h, tp = spec.hidden_size, p.tensor
    total = spec.num_parameters()
    embed = spec.vocab_size * h
    # an MoE layer's routed experts are split over TP x EP ranks, the rest over TP (the first
    # dense_layers have none)
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    experts = spec.num_experts * 3 * h * spec.moe_ffn_hidden_size * moe_layers
    vocab_rows = spec.padded_vocab_size(tp) // tp
    # the first stage holds the embedding, the last the output layer (a copy when tied)
    layers_params = (total - embed * (1 if spec.tie_embeddings else 2) - h - experts) / tp \
        / p.pipeline
    dense_params = layers_params + vocab_rows * h
    if p.pipeline == 1 and not spec.tie_embeddings:
        dense_params += vocab_rows * h
    expert_params = experts / (tp * p.expert) / p.pipeline
    stage_params = dense_params + expert_params
    w = BYTES[cfg.model.dtype]
    params_b = stage_params * w
    grads_b = stage_params * 4
    opt_per_param = 12 if w < 4 else 8
    # the distributed optimizer shards the experts' state over the expert-data-parallel group,
    # the rest over all dp (x cp: megatron's dp_cp group). Expert layers see no CP: megatron-core
    # (0.16.1-0.19.2 ``initialize_model_parallel``) makes the expert-data-parallel size world /
    # (expert TP x EP x PP) = dp x cp / ep, the CP ranks holding the same experts as DP ranks do
    shard_dense, shard_expert = (dp * p.context, dp * p.context // p.expert) \
        if p.distributed_optimizer else (1, 1)
    optim_b = opt_per_param * (dense_params / shard_dense + expert_params / shard_expert)
    state = params_b + grads_b + optim_b

    tokens = microbatch_tokens(cfg, spec)[0]
    act, in_flight = activation_bytes(cfg, spec, dp, cfg.model.recompute)
    logits = logits_bytes(tokens, vocab_rows, cfg.model.dtype, r.temperature,
                          entropy_grad=cfg.algo.entropy_coef > 0)

    # not freed by any offload: the process, NCCL, and FP8's weight caches (the GEMM weights)
    fp8_cache = 2 * (layers_params + expert_params) if cfg.model.fp8_format else 0.0
    comms = communicators(cfg, dp)
    nccl = NCCL_PER_COMMUNICATOR * sum(comms.values())

    fp8 = r.quantization == "fp8"
    engine_tensors = EngineTensors.of(spec, r.tensor_parallel, cfg.model.dtype, fp8)
    engine_weights = engine_tensors.total
    engine_budget = r.gpu_memory_utilization * gpu_gib * GIB
    kv = max(0.0, engine_budget - engine_weights)
    kv_per_token = spec.num_layers * spec.kv_cache_values(r.tensor_parallel) * (
        1 if r.kv_cache_dtype.startswith("fp8") else 2)
    vllm = r.engine == "vllm"
    # the non-deferrable pools (runtime, workspaces, CUDA graphs): woken with the weights
    pools = (VLLM_RUNTIME + moe_workspace(spec, r.tensor_parallel, cfg.model.dtype)
             + VLLM_GRAPH_POOL) if vllm else 0.0
    # awake, all of it inside the engine's budget (vLLM >= 0.21 counts its CUDA graphs in)
    engine_awake = max(engine_budget, engine_weights + pools)
    engine_asleep = 0.0 if r.sleep_between_phases else engine_awake
    offloaded = p.offload_learner != "never"
    learner_while_generating = 0.0 if offloaded else state
    # offloaded, a sync streams from the learner's host copy: one parameter on the device at a
    # time (the largest: the vocabulary's shard, or a dense layer's gate and up projection)
    largest_param = max(vocab_rows * h, 2 * spec.ffn_hidden_size * h / tp) * w
    learner_at_sync = largest_param if offloaded else state
    stream = stream_bytes(spec, tp, p.pipeline, r.weight_bucket_mb << 20, cfg.model.dtype)
    reload = reload_bytes(spec, r.tensor_parallel, cfg.model.dtype, fp8) if vllm else 0.0
    sync_cut, sync = sync_bytes(cfg, spec, total, dp * tp * p.context)
    reference = bool(cfg.algo.kl_coef) and cfg.algo.kl_target == "reference"
    # a no-grad forward keeps one layer's activations at a time, and its logits (no copy for
    # a backward): the reference's weights in the learner's storages, its own state on the host
    forward = full_layer_bytes(cfg, spec, tokens) + logits_bytes(tokens, vocab_rows,
                                                                cfg.model.dtype, r.temperature)
    # each transition's items: the learner's, the engine's ("engine ..."), what no offload frees
    grouped = GROUPED_GEMM_WORKSPACE if spec.is_moe else 0.0
    base = {"CUDA context": CUDA_CONTEXT, "NCCL": nccl, "grouped GEMM workspace": grouped}
    held = {**base, "FP8 caches": fp8_cache}
    items = {
        "start": {**base, "engine awake": engine_awake, "learner": learner_while_generating},
        "sync": {**held, "learner": learner_at_sync, "engine weights": engine_weights,
                 "engine pools": pools, "stream": stream, "engine reload": reload},
        "generate": {**held, "engine awake": engine_awake, "learner": learner_while_generating},
        "evaluate": {**held, "engine awake": engine_awake, "learner": learner_while_generating},
        "reference": {**held, "learner": params_b if offloaded else state,
                      "reference forward": forward, "engine asleep": engine_asleep},
        "optimize": {**held, "learner": state, "activations": act, "logits": logits,
                     "CP ring": cp_ring_bytes(cfg, spec), "engine asleep": engine_asleep},
        "save": {**held, "learner": state, "engine asleep": engine_asleep},
    }
    if not reference:
        del items["reference"]
    transitions = {name: sum(parts.values()) for name, parts in items.items()}
    peak_name = max(transitions, key=transitions.get)
    margin = MARGIN * gpu_gib * GIB
    # the run's peak with each recomputation choice (only the optimizer's transition changes)
    peak_by_recompute = {
        choice: max(*(v for k, v in transitions.items() if k != "optimize"),
                    transitions["optimize"] - act + activation_bytes(cfg, spec, dp, choice)[0])
        for choice in RECOMPUTE_COST}
    fitting = [c for c, v in peak_by_recompute.items() if v + margin <= gpu_gib * GIB]
    # host, pinned: the learner's offload in chunks, the sleeping engine's backups one by one
    learner_host = math.ceil((params_b + optim_b) / HOST_CHUNK) * HOST_CHUNK if offloaded else 0
    # the learner's weights twice on the host where it is not offloaded (its own, swapped out)
    reference_host = (1 + (not offloaded)) * math.ceil(params_b / HOST_CHUNK) * HOST_CHUNK \
        if reference else 0
    # level 2: the pools, not the weights
    engine_host = (pinned(VLLM_RUNTIME) + pinned(VLLM_GRAPH_POOL)
                   if vllm and r.sleep_between_phases else 0)
    # the engine's share: the largest gpu_memory_utilization each transition with the engine
    # awake allows beside what else is on the GPU then (and the margin), and the max-length
    # sequences a replica's KV cache holds at once, at this config's share and at that one
    others = {n: transitions[n] - parts["engine awake"] for n, parts in items.items()
              if "engine awake" in parts}
    share_max = {n: (gpu_gib * GIB - margin - v) / (gpu_gib * GIB) for n, v in others.items()}
    kv_at_max = max(0.0, min(share_max.values()) * gpu_gib * GIB - engine_weights)
    phase_tokens = cfg.algo.prompts_per_phase * r.group_size * cfg.max_sequence_tokens
    world = dp * p.tensor * p.pipeline * p.context
    return {
        "dp": dp, "gpu_gib": gpu_gib, "parameters_total": total,
        "parameters_per_gpu": stage_params, "params": params_b, "grads": grads_b,
        "optimizer": optim_b, "learner_state": state, "learner_at_sync": learner_at_sync,
        "activations": act, "logits": logits, "learner": state + act + logits,
        "cp_ring": cp_ring_bytes(cfg, spec),
        "cuda_context": CUDA_CONTEXT, "nccl": nccl, "grouped_gemm": grouped,
        "communicators": comms, "fp8_cache": fp8_cache,
        "engine_weights": engine_weights, "kv_cache": kv, "kv_tokens": kv / kv_per_token,
        "engine_share_max": share_max,
        "sequences_at_once": int(kv / kv_per_token // cfg.max_sequence_tokens),
        "sequences_at_share_max": int(kv_at_max / kv_per_token // cfg.max_sequence_tokens),
        "engine": engine_awake, "engine_pools": pools, "stream": stream, "reload": reload,
        "sync_bytes": sync, "sync_cut": sync_cut,
        "offloaded": offloaded, "transitions": transitions, "transition_items": items,
        "peak_transition": peak_name,
        "peak": transitions[peak_name], "margin": margin,
        "peak_by_recompute": peak_by_recompute,
        "cheapest_recompute": fitting[0] if fitting else None,
        "host_learner": learner_host, "host_engine": engine_host,
        "host_reference": reference_host,
        "host_per_node": ranks_per_node * (learner_host + engine_host + reference_host),
        "host_unrounded_per_node": ranks_per_node * ((params_b + optim_b if offloaded else 0)
                                                     + (VLLM_RUNTIME + VLLM_GRAPH_POOL
                                                        if engine_host else 0)
                                                     + (params_b if reference else 0)),
        "reference_tokens": phase_tokens if reference else 0,
        "reference_seconds": 2 * total * phase_tokens / (world * ASSUMED_MFU * DATASHEET_BF16)
        if reference else 0.0,
        "ranks_per_node": ranks_per_node, "microbatches_in_flight": in_flight,
        "seq_len": cfg.max_sequence_tokens,
    }

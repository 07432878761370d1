"""``plan`` and ``train --dry-run``: what a config does at a world size, no GPU needed. ``plan``
validates the layout and states the schedule; the dry run also estimates per-GPU memory at every
transition of a phase.

The estimate is arithmetic on the architecture (from the checkpoint's ``config.json``). What one
rank holds:

- learner state: this rank's parameters (TP x PP split; the first and last stages also hold the
  padded embedding and output layer) in the training dtype; gradients in fp32 (megatron DDP's
  ``grad_reduce_in_fp32``); fp32 master weights and Adam's two moments (12 bytes a parameter,
  8 in fp32 training), divided by DP with the distributed optimizer. ``parallel.offload_learner``
  moves it to host memory while the engine generates.
- activations: Korthikanti et al. (2022), 34*s*b*h bytes per layer and microbatch (s*b: the
  tokens of the largest microbatch, a packed row where the learner packs), divided by TP
  with sequence parallel (10 of the 34 stay replicated without it), with flash attention (no
  s^2 term, so selective recomputation, which recomputes only that part, saves nothing); with
  full recomputation each layer keeps its input, 2*s*b*h (divided by TP with sequence parallel),
  and one layer's activations exist at a time in the backward pass; the first pipeline stage
  holds up to PP microbatches in flight under 1F1B; plus the fp32 logits of one microbatch and
  their gradient. Each ``model.recompute`` is estimated; the cheapest that fits is named.
- what no offload frees (``RESIDENT``): the CUDA context and library workspaces; NCCL's buffers,
  per communicator the rank uses; with FP8, Transformer Engine's FP8 copy of every GEMM weight and
  its transpose (kept between microbatches and steps, not parameters: 2 bytes a GEMM parameter).
- engine: its budget (``rollout.gpu_memory_utilization`` of the GPU: weights at the engine's TP
  size, KV cache, activations), plus vLLM's CUDA-graph pool (inside the budget from vLLM 0.21,
  outside before: counted on top, so a margin on newer releases), which sleep does not free.

The transitions of a phase, each with what is on the device then: start (the engine starts while
the learner is offloaded), sync (the engine's weights woken alone, beside the learner, and a bucket
of gathered tensors), generate and evaluate (the whole engine, the learner offloaded), optimize
(the learner, its activations, the sleeping engine's graph pool), save (the learner; megatron's
writer copies the rank's shards to host memory before it writes them). The verdict is the largest, and it
must leave ``MARGIN`` of the GPU free for the allocator's fragmentation and what this model does
not know. Host memory per node (the offload pool, the sleeping engine's weights) is printed too.
"""

from __future__ import annotations

from pathlib import Path

from mugrpo_megatron.config import Config
from mugrpo_megatron.layout import check_layout, pack_capacity, token_multiple
from mugrpo_megatron.models.hf_config import ModelSpec, read_model_spec
from mugrpo_megatron.phase.schedule import describe_schedule

GIB = 1 << 30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CUDA_CONTEXT = 1.0 * GIB
"""CUDA context, cuBLAS/cuDNN and Transformer Engine workspaces of one process (~0.5-1 GiB)."""
NCCL_PER_COMMUNICATOR = 0.5 * GIB
"""NCCL buffers of one communicator: NCCL_BUFFSIZE (4 MiB) per channel and peer for the Simple
protocol, plus LL/LL128, on up to 32 channels; NVLS (NVSwitch systems) adds more per communicator
(NCCL_NVLS_ENABLE=0 turns it off)."""
VLLM_GRAPH_POOL = 2.0 * GIB
"""vLLM's CUDA-graph memory (captured batch sizes up to 512), kept while it sleeps."""
MARGIN = 0.05
"""Fraction of the GPU the largest transition must leave free."""
TRANSITIONS = ("start", "sync", "generate", "evaluate", "optimize", "save")
RECOMPUTE_COST = {"none": "fastest", "selective": "+ core attention's forward",
                  "full": "~1/3 more compute an update"}
"""``model.recompute``'s choices, cheapest first, with what each adds to an update."""


def microbatch_tokens(cfg: Config) -> tuple[int, str]:
    """Tokens of the largest microbatch on a GPU (Transformer Engine installed, as the GPU
    install has it), and how they are laid out: a packed row (``parallel.pack_tokens``: 'auto'
    packs there, into rows of micro_batch_size x the longest sequence), or micro_batch_size rows
    padded to the longest sequence."""
    p = cfg.parallel
    packed = pack_capacity(p, cfg.max_sequence_tokens, thd=True,
                           multiple=token_multiple(cfg.model, p))
    if packed:
        return packed, f"packed rows of {packed} tokens (THD through Transformer Engine)"
    return p.micro_batch_size * cfg.max_sequence_tokens, \
        f"{p.micro_batch_size} row(s) padded to the rank's longest (up to {cfg.max_sequence_tokens})"


def activation_bytes(cfg: Config, spec: ModelSpec, dp: int, recompute: str) -> tuple[float, int]:
    """Activation memory of the first pipeline stage during an update with ``recompute``, and the
    microbatches it holds in flight (1F1B: up to PP)."""
    p = cfg.parallel
    tokens = microbatch_tokens(cfg)[0]  # s x b of the formulas
    h, tp = spec.hidden_size, p.tensor
    layers_stage = spec.num_layers / p.pipeline
    in_flight = min(p.pipeline, max(1, cfg.algo.samples_per_update // (dp * p.micro_batch_size)))
    full_layer = tokens * h * (34 / tp if p.sequence_parallel or tp == 1 else 24 / tp + 10)
    if recompute == "full":  # the layers' inputs of every microbatch in flight, one layer's all
        inputs = 2 * tokens * h / (tp if p.sequence_parallel else 1) * layers_stage
        return inputs * in_flight + full_layer, in_flight
    return full_layer * layers_stage * in_flight, in_flight  # selective: no s^2 term to drop


def _communicators(cfg: Config, dp: int) -> int:
    """NCCL communicators a rank uses: the world, TP, DP, two pipeline neighbours and the
    embedding group, EP, and the engine's tensor-parallel group."""
    p = cfg.parallel
    return (1 + (p.tensor > 1) + (dp > 1) + 3 * (p.pipeline > 1) + (p.expert > 1)
            + (cfg.rollout.tensor_parallel > 1))


def estimate(cfg: Config, spec: ModelSpec, world_size: int, gpu_gib: float = 80.0,
             gpus_per_node: int | None = None) -> dict:
    p = cfg.parallel
    layout = check_layout(cfg, world_size, gpus_per_node, spec)  # as train checks it
    dp = layout.data_parallel
    h, tp = spec.hidden_size, p.tensor
    total = spec.num_parameters()
    embed = spec.vocab_size * h
    layer_params = (total - embed * (1 if spec.tie_embeddings else 2) - h) / spec.num_layers
    # an MoE layer's experts are split over TP x EP ranks, the rest over TP
    expert_layer = spec.num_experts * 3 * h * spec.moe_ffn_hidden_size
    vocab_rows = spec.padded_vocab_size(tp) // tp
    # the first stage holds the embedding, the last the output layer (a copy when tied)
    layers_params = (layer_params - expert_layer) / tp * spec.num_layers / p.pipeline
    dense_params = layers_params + vocab_rows * h
    if p.pipeline == 1 and not spec.tie_embeddings:
        dense_params += vocab_rows * h
    expert_params = expert_layer / (tp * p.expert) * spec.num_layers / p.pipeline
    stage_params = dense_params + expert_params
    w = BYTES[cfg.model.dtype]
    params_b = stage_params * w
    grads_b = stage_params * 4
    opt_per_param = 12 if w < 4 else 8
    # the distributed optimizer shards the experts' state over the expert-data-parallel group
    # (dp / ep ranks hold the same experts), the rest over all dp ranks
    shard_dense, shard_expert = (dp, dp // p.expert) if p.distributed_optimizer else (1, 1)
    optim_b = opt_per_param * (dense_params / shard_dense + expert_params / shard_expert)
    state = params_b + grads_b + optim_b

    act, in_flight = activation_bytes(cfg, spec, dp, cfg.model.recompute)
    logits = 2 * microbatch_tokens(cfg)[0] * vocab_rows * 4

    # not freed by any offload: the process, NCCL, and FP8's weight caches (the GEMM weights)
    fp8_cache = 2 * (layers_params + expert_params) if cfg.model.fp8_format else 0.0
    nccl = NCCL_PER_COMMUNICATOR * _communicators(cfg, dp)
    resident = CUDA_CONTEXT + nccl + fp8_cache

    r = cfg.rollout
    engine_weights = total * 2 / r.tensor_parallel
    engine_budget = r.gpu_memory_utilization * gpu_gib * GIB
    kv = max(0.0, engine_budget - engine_weights)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 / r.tensor_parallel
    graphs = VLLM_GRAPH_POOL if r.engine == "vllm" else 0.0  # SGLang's sleep frees its graphs
    engine_awake = max(engine_budget, engine_weights) + graphs
    engine_asleep = graphs if r.sleep_between_phases else engine_awake
    offloaded = p.offload_learner != "never"
    learner_while_generating = 0.0 if offloaded else state
    bucket = 2 * (r.weight_bucket_mb << 20)  # a bucket of gathered tensors and its TP shards
    transitions = {
        "start": CUDA_CONTEXT + nccl + engine_awake + learner_while_generating,
        "sync": resident + state + engine_weights + graphs + bucket,
        "generate": resident + engine_awake + learner_while_generating,
        "evaluate": resident + engine_awake + learner_while_generating,
        "optimize": resident + state + act + logits + engine_asleep,
        "save": resident + state + engine_asleep,
    }
    peak_name = max(transitions, key=transitions.get)
    margin = MARGIN * gpu_gib * GIB
    # the run's peak with each recomputation choice (only the optimizer's transition changes)
    peak_by_recompute = {
        choice: max(*(v for k, v in transitions.items() if k != "optimize"),
                    transitions["optimize"] - act + activation_bytes(cfg, spec, dp, choice)[0])
        for choice in RECOMPUTE_COST}
    fitting = [c for c, v in peak_by_recompute.items() if v + margin <= gpu_gib * GIB]
    ranks = gpus_per_node or world_size
    host_per_rank = (params_b + optim_b if offloaded else 0.0) + engine_weights
    return {
        "world_size": world_size, "dp": dp, "gpu_gib": gpu_gib, "placement": layout.placement,
        "parameters_total": total, "parameters_per_gpu": stage_params,
        "params": params_b, "grads": grads_b, "optimizer": optim_b, "learner_state": state,
        "activations": act, "logits": logits, "learner": state + act + logits,
        "cuda_context": CUDA_CONTEXT, "nccl": nccl, "fp8_cache": fp8_cache,
        "engine_weights": engine_weights, "kv_cache": kv, "kv_tokens": kv / kv_per_token,
        "engine": engine_awake, "engine_graphs": graphs, "offloaded": offloaded,
        "transitions": transitions, "peak_transition": peak_name,
        "peak": transitions[peak_name], "margin": margin,
        "peak_by_recompute": peak_by_recompute,
        "cheapest_recompute": fitting[0] if fitting else None,
        "host_per_node": ranks * host_per_rank, "ranks_per_node": ranks,
        "microbatches_in_flight": in_flight, "seq_len": cfg.max_sequence_tokens,
    }


def dry_run(cfg: Config, world_size: int, hf_config: str | Path | None = None,
            gpu_gib: float = 80.0, gpus_per_node: int | None = None) -> str:
    if not (hf_config or cfg.model.path):
        raise ValueError("model.path: not set; the dry run reads the model's config.json from "
                         "it, or from --hf-config")
    spec = read_model_spec(Path(hf_config) if hf_config else Path(cfg.model.path))
    e = estimate(cfg, spec, world_size, gpu_gib, gpus_per_node)
    p, r = cfg.parallel, cfg.rollout
    g = lambda x: f"{x / GIB:6.1f} GiB"  # noqa: E731
    on_device = {"start": "engine starting, learner offloaded" if e["offloaded"] else
                 "engine starting beside the learner",
                 "sync": "engine weights woken beside the learner, a bucket in flight",
                 "generate": "whole engine" + (", learner offloaded" if e["offloaded"] else
                                               " beside the learner"),
                 "evaluate": "whole engine" + (", learner offloaded" if e["offloaded"] else
                                               " beside the learner"),
                 "optimize": "learner, activations, logits; engine " +
                             ("asleep (graph pool)" if r.sleep_between_phases else "awake"),
                 "save": "learner; its shards are copied to host memory to be written"}
    lines = [
        f"model: {spec.architecture}, {e['parameters_total'] / 1e9:.2f}B parameters, "
        f"{spec.num_layers} layers, vocab {spec.vocab_size} (padded {spec.padded_vocab_size(p.tensor)})",
        f"layout: world {world_size} = TP {p.tensor} x PP {p.pipeline}"
        + (f" (virtual {p.virtual_pipeline})" if p.virtual_pipeline else "")
        + f" x DP {e['dp']}; sequence parallel {p.sequence_parallel}; distributed optimizer "
          f"{p.distributed_optimizer}; {e['placement'].describe()}",
        f"schedule: {describe_schedule(cfg)}; microbatches: {microbatch_tokens(cfg)[1]}",
        f"precision: {cfg.model.dtype}" + (f", FP8 {cfg.model.fp8_format} ({cfg.model.fp8_recipe})"
                                           if cfg.model.fp8_format else ""),
        f"per-GPU memory (sequence {e['seq_len']} tokens, {e['microbatches_in_flight']} "
        f"microbatches in flight):",
        f"  parameters      {g(e['params'])}  ({e['parameters_per_gpu'] / 1e9:.2f}B on the largest stage)",
        f"  gradients       {g(e['grads'])}  (fp32)",
        f"  optimizer       {g(e['optimizer'])}",
        f"  activations     {g(e['activations'])}",
        f"  logits          {g(e['logits'])}",
        f"  CUDA context    {g(e['cuda_context'])}",
        f"  NCCL buffers    {g(e['nccl'])}",
        f"  FP8 caches      {g(e['fp8_cache'])}  (Transformer Engine's FP8 weights; never offloaded)",
        f"  engine weights  {g(e['engine_weights'])}",
        f"  engine KV cache {g(e['kv_cache'])}  ({e['kv_tokens']:,.0f} tokens)",
        f"  engine graphs   {g(e['engine_graphs'])}  (kept while the engine sleeps)",
        "per-GPU memory at each transition of a phase:",
        *[f"  {name:<9} {g(v)}  ({on_device[name]})" for name, v in e["transitions"].items()],
        f"  peak      {g(e['peak'])}  at {e['peak_transition']}, of {gpu_gib:.0f} GiB "
        f"(a margin of {g(e['margin']).strip()} kept free)",
        f"host memory per node ({e['ranks_per_node']} ranks): {g(e['host_per_node']).strip()} "
        f"(offload pool and the sleeping engine's weights, pinned)",
        "peak with each model.recompute: " + ", ".join(
            f"{c} {v / GIB:.1f} GiB ({RECOMPUTE_COST[c]})" for c, v in e["peak_by_recompute"].items())
        + f"; the cheapest that fits: {e['cheapest_recompute'] or 'none of them'} (this config: "
          f"{cfg.model.recompute})",
    ]
    if e["peak"] + e["margin"] > gpu_gib * GIB:
        raise ValueError("\n".join(lines) + f"\nthe estimate ({e['peak'] / GIB:.1f} GiB at "
                         f"{e['peak_transition']}, plus the margin) does not fit "
                         f"{gpu_gib:.0f} GiB per GPU: raise parallel.tensor/pipeline, enable "
                         f"recompute, the distributed optimizer or parallel.offload_learner, or "
                         f"lower rollout.gpu_memory_utilization")
    if e["kv_tokens"] < cfg.max_sequence_tokens:
        raise ValueError("\n".join(lines) + "\nthe engine's KV cache cannot hold one sequence: raise "
                         "rollout.gpu_memory_utilization or rollout.tensor_parallel")
    lines.append("fits: yes")
    return "\n".join(lines)


def plan(cfg: Config, world_size: int, gpus_per_node: int | None = None) -> str:
    """The ``plan`` command: the layout (checked) and the schedule in words."""
    layout = check_layout(cfg, world_size, gpus_per_node)
    a = cfg.algo
    veto = ("off" if a.veto_threshold is None
            else f"below {a.veto_threshold:g}, scope {a.veto_scope}")
    return "\n".join([
        f"world size {world_size}: TP {cfg.parallel.tensor} x PP {cfg.parallel.pipeline} x DP "
        f"{layout.data_parallel}; {layout.placement.describe()}",
        f"schedule: {describe_schedule(cfg)}",
        f"clip ratio to [{1 - a.clip_low:g}, {1 + a.clip_high:g}]; veto {veto}"])

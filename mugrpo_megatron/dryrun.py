"""``train --dry-run``: validate a config for a world size and estimate per-GPU memory, no GPU needed.

The estimate is arithmetic on the architecture (from the checkpoint's ``config.json``):

- parameters: this rank's share (TP x PP split; the first and last stages also hold the padded
  embedding and output layer), in the training dtype;
- gradients: megatron DDP keeps them in fp32 (``grad_reduce_in_fp32``);
- optimizer: fp32 master weights and Adam's two moments (12 bytes per parameter; 16-bit training
  only, fp32 training has no separate master copy), divided by DP with the distributed optimizer;
- activations: Korthikanti et al. (2022), 34*s*b*h bytes per layer and microbatch, divided by TP
  with sequence parallel (10 of the 34 stay replicated without it), with flash attention (the TE
  spec on GPUs) so no s^2 term; with full recomputation 2*s*b*h per layer plus one layer
  recomputed; the first pipeline stage holds up to PP microbatches in flight under 1F1B; plus the
  fp32 logits of one microbatch and their gradient;
- engine: the policy's weights at the engine's TP size (bf16) and the KV cache that the engine's
  memory fraction leaves, with the number of tokens that cache holds.

With ``parallel.offload_learner`` 'auto' (the default: on, on GPUs) or 'always', the learner's
memory goes to the host while the engine starts and generates, the engine sleeps while the
learner trains, and a weight sync wakes only the engine's weights: the peak is the larger of
learner + engine weights and the engine's whole budget. With 'never' all of it must fit at once.
"""

from __future__ import annotations

from pathlib import Path

from mugrpo_megatron.config import Config
from mugrpo_megatron.learner.hf_config import ModelSpec, read_model_spec
from mugrpo_megatron.scheduler import describe_schedule

GIB = 1 << 30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def estimate(cfg: Config, spec: ModelSpec, world_size: int, gpu_gib: float = 80.0,
             gpus_per_node: int | None = None) -> dict:
    p = cfg.parallel
    dp = cfg.check_world_size(world_size, gpus_per_node)
    spec.check_tensor_parallel(p.tensor)
    spec.check_expert_parallel(p.expert)
    stages = p.pipeline * (p.virtual_pipeline or 1)
    if spec.num_layers % stages:
        raise ValueError(f"parallel.pipeline x virtual_pipeline = {stages} does not divide the "
                         f"{spec.num_layers} layers")
    h, tp = spec.hidden_size, p.tensor
    total = spec.num_parameters()
    embed = spec.vocab_size * h
    layer_params = (total - embed * (1 if spec.tie_embeddings else 2) - h) / spec.num_layers
    # an MoE layer's experts are split over TP x EP ranks, the rest over TP
    expert_layer = spec.num_experts * 3 * h * spec.moe_ffn_hidden_size
    vocab_rows = spec.padded_vocab_size(tp) // tp
    # the first stage holds the embedding, the last the output layer (a copy when tied)
    dense_params = (layer_params - expert_layer) / tp * spec.num_layers / p.pipeline + vocab_rows * h
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

    s = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    b = p.micro_batch_size
    layers_stage = spec.num_layers / p.pipeline
    full_layer = s * b * h * (34 / tp if p.sequence_parallel or tp == 1 else 24 / tp + 10)
    if cfg.model.recompute_activations:
        act = 2 * s * b * h * layers_stage + full_layer
    else:
        act = full_layer * layers_stage
    in_flight = min(p.pipeline, max(1, cfg.algo.samples_per_update // (dp * b)))
    act *= in_flight
    logits = 2 * s * b * vocab_rows * 4
    learner = params_b + grads_b + optim_b + act + logits

    r = cfg.rollout
    engine_weights = total * 2 / r.tensor_parallel
    engine_budget = r.gpu_memory_utilization * gpu_gib * GIB
    kv = max(0.0, engine_budget - engine_weights)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 / r.tensor_parallel
    engine = max(engine_budget, engine_weights)
    offloaded = cfg.parallel.offload_learner != "never"
    return {
        "world_size": world_size, "dp": dp, "gpu_gib": gpu_gib,
        "parameters_total": total, "parameters_per_gpu": stage_params,
        "params": params_b, "grads": grads_b, "optimizer": optim_b, "activations": act,
        "logits": logits, "learner": learner, "engine_weights": engine_weights, "kv_cache": kv,
        "kv_tokens": kv / kv_per_token, "engine": engine, "offloaded": offloaded,
        # offloaded: the learner meets only the engine's weights (the weight sync, before the KV
        # cache is woken); resident: it meets the whole engine
        "peak": max(learner + engine_weights, engine) if offloaded else learner + engine,
        "microbatches_in_flight": in_flight, "seq_len": s,
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
    lines = [
        f"model: {spec.architecture}, {e['parameters_total'] / 1e9:.2f}B parameters, "
        f"{spec.num_layers} layers, vocab {spec.vocab_size} (padded {spec.padded_vocab_size(p.tensor)})",
        f"layout: world {world_size} = TP {p.tensor} x PP {p.pipeline}"
        + (f" (virtual {p.virtual_pipeline})" if p.virtual_pipeline else "")
        + f" x DP {e['dp']}; sequence parallel {p.sequence_parallel}; distributed optimizer "
          f"{p.distributed_optimizer}; {r.describe_placement(world_size, gpus_per_node)}",
        f"schedule: {describe_schedule(cfg)}; microbatches of {p.micro_batch_size}",
        f"precision: {cfg.model.dtype}" + (f", FP8 {cfg.model.fp8_format} ({cfg.model.fp8_recipe})"
                                           if cfg.model.fp8_format else ""),
        f"per-GPU memory estimate (sequence {e['seq_len']} tokens, {e['microbatches_in_flight']} "
        f"microbatches in flight):",
        f"  parameters      {g(e['params'])}  ({e['parameters_per_gpu'] / 1e9:.2f}B on the largest stage)",
        f"  gradients       {g(e['grads'])}  (fp32)",
        f"  optimizer       {g(e['optimizer'])}",
        f"  activations     {g(e['activations'])}",
        f"  logits          {g(e['logits'])}",
        f"  learner total   {g(e['learner'])}",
        f"  engine weights  {g(e['engine_weights'])}",
        f"  engine KV cache {g(e['kv_cache'])}  ({e['kv_tokens']:,.0f} tokens)",
        f"  peak            {g(e['peak'])}  of {gpu_gib:.0f} GiB ("
        + ("learner offloaded while the engine generates)" if e["offloaded"]
           else "learner resident while the engine generates)"),
    ]
    if e["peak"] > gpu_gib * GIB:
        raise ValueError("\n".join(lines) + f"\nthe estimate ({e['peak'] / GIB:.1f} GiB) does not fit "
                         f"{gpu_gib:.0f} GiB per GPU: raise parallel.tensor/pipeline, enable "
                         f"recompute, the distributed optimizer or parallel.offload_learner, or "
                         f"lower rollout.gpu_memory_utilization")
    if e["kv_tokens"] < r.max_new_tokens + cfg.data.max_prompt_tokens:
        raise ValueError("\n".join(lines) + "\nthe engine's KV cache cannot hold one sequence: raise "
                         "rollout.gpu_memory_utilization or rollout.tensor_parallel")
    lines.append("fits: yes")
    return "\n".join(lines)

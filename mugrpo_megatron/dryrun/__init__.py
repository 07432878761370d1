"""``plan`` and ``train --dry-run``: what a config does at a world size, no GPU needed. ``plan``
validates the layout and states the schedule; the dry run also estimates per-GPU memory at every
transition of a phase, and host memory per node (the model: ``dryrun.memory``).
"""

from __future__ import annotations

from pathlib import Path

from mugrpo_megatron.config import Config
from mugrpo_megatron.dryrun import cost
from mugrpo_megatron.dryrun.compute import update_seconds
from mugrpo_megatron.dryrun.memory import (
    ASSUMED_MFU,
    DATASHEET_BF16,
    GIB,
    H100_GIB,
    RECOMPUTE_COST,
    estimate,
    microbatch_tokens,
)
from mugrpo_megatron.layout import check_layout, context_comm_type
from mugrpo_megatron.models.hf_config import read_model_spec
from mugrpo_megatron.phase.schedule import describe_schedule

SYNC_CUT = {
    "own shards": "(its own TP shards of the projections and experts: the engine's TP ranks are "
                  "the learner's)",
    "engine slices": "(the slices of the projections and experts its engine rank keeps, sent by "
                     "the learner ranks that hold them: the engine's TP is a multiple of the "
                     "learner's)",
    "whole": "(every tensor whole, each engine rank narrowing what it keeps: the engine's TP is "
             "neither the learner's nor a multiple of it that the stream can cut for)",
}
"""How a sync's stream is cut (``dryrun.memory.sync_bytes``), in words."""


def dry_run(cfg: Config, world_size: int, hf_config: str | Path | None = None,
            gpu_gib: float = H100_GIB, gpus_per_node: int | None = None) -> str:
    """The layout checked as ``train`` checks it, and every memory figure of ``dryrun.memory``
    in words; ValueError, with the figures, when the largest transition does not fit."""
    if not (hf_config or cfg.model.path):
        raise ValueError("model.path: not set; the dry run reads the model's config.json from "
                         "it, or from --hf-config")
    spec = read_model_spec(Path(hf_config) if hf_config else Path(cfg.model.path))
    layout = check_layout(cfg, world_size, gpus_per_node, spec)  # as train checks it
    e = estimate(cfg, spec, layout.data_parallel, gpu_gib, gpus_per_node or world_size)
    p, r = cfg.parallel, cfg.rollout
    g = lambda x: f"{x / GIB:6.1f} GiB"  # noqa: E731
    apart = ", learner offloaded" if e["offloaded"] else " beside the learner"
    on_device = {"start": "engine starting" + apart,
                 "sync": ("one of the learner's weights at a time, streamed from its host copy"
                          if e["offloaded"] else "the learner's weights and state")
                         + ", the engine's weights and pools woken, the stream and what the "
                           "engine's reload holds of it",
                 "generate": "whole engine" + apart, "evaluate": "whole engine" + apart,
                 "reference": "the reference's weights in the learner's storages ("
                              + ("its own on the host" if e["offloaded"] else "its own state "
                                 "beside them") + "), one no-grad microbatch and its logits",
                 "optimize": "learner, activations, logits; engine "
                             + ("asleep (nothing on the device)" if r.sleep_between_phases
                                else "awake"),
                 "save": "learner; its shards are copied to host memory to be written"}
    comms = ", ".join(f"{k} {v}" for k, v in e["communicators"].items())
    u = update_seconds(cfg, spec, e["dp"], world_size)
    lines = [
        f"model: {spec.architecture}, {e['parameters_total'] / 1e9:.2f}B parameters, "
        f"{spec.num_layers} layers, vocab {spec.vocab_size} (padded {spec.padded_vocab_size(p.tensor)})",
        f"layout: world {world_size} = TP {p.tensor} x PP {p.pipeline}"
        + (f" (virtual {p.virtual_pipeline})" if p.virtual_pipeline else "")
        + (f" x CP {p.context} ({context_comm_type(spec, p)} exchange"
           + (", chosen by rule" if p.cp_comm_type == "auto" else "") + ")"
           if p.context > 1 else "")
        + f" x DP {e['dp']}; sequence parallel {p.sequence_parallel}; distributed optimizer "
          f"{p.distributed_optimizer}; {layout.placement.describe()}",
        f"schedule: {describe_schedule(cfg)}; microbatches: {microbatch_tokens(cfg, spec)[1]}",
        f"precision: {cfg.model.dtype}" + (f", FP8 {cfg.model.fp8_format} ({cfg.model.fp8_recipe})"
                                           if cfg.model.fp8_format else ""),
        *([stored_checkpoint(cfg, spec)] if spec.stored is not None else []),
        *([f"experts: {spec.num_experts // p.expert} a rank in each of "
           f"{sum(spec.is_moe_layer(i) for i in range(spec.num_layers))} MoE layers, run as one "
           f"grouped GEMM (Transformer Engine's TEGroupedMLP; {g(e['grouped_gemm']).strip()} of "
           f"cuBLAS workspace a GPU); megatron's SequentialMLP, one GEMM an expert, on CPU"]
          if spec.is_moe else []),
        f"per-GPU memory (sequence {e['seq_len']} tokens, {e['microbatches_in_flight']} "
        f"microbatches in flight):",
        f"  parameters      {g(e['params'])}  ({e['parameters_per_gpu'] / 1e9:.2f}B on the largest stage)",
        f"  gradients       {g(e['grads'])}  (fp32)",
        f"  optimizer       {g(e['optimizer'])}",
        f"  activations     {g(e['activations'])}"
        + (f"  (a CP rank's share; TE's K/V ring {g(e['cp_ring']).strip()} more)"
           if p.context > 1 else ""),
        f"  logits          {g(e['logits'])}  (fp32, worked on in place, beside the output "
        f"layer's)",
        f"  CUDA context    {g(e['cuda_context'])}",
        f"  NCCL buffers    {g(e['nccl'])}  ({sum(e['communicators'].values())} communicators: "
        f"{comms})",
        f"  FP8 caches      {g(e['fp8_cache'])}  (Transformer Engine's FP8 weights; never offloaded)",
        f"  engine weights  {g(e['engine_weights'])}"
        + ("  (block FP8: the layers' linear weights a byte an element and a float32 scale a "
           "128 x 128 block)" if r.quantization == "fp8" else ""),
        f"  engine KV cache {g(e['kv_cache'])}  ({e['kv_tokens']:,.0f} tokens"
        + (f", {r.kv_cache_dtype}" if r.kv_cache_dtype != "auto" else "") + ")",
        f"  engine pools    {g(e['engine_pools'])}  (runtime, workspaces, CUDA graphs: woken "
        f"with the weights; on the host while the engine sleeps)",
        f"  weight stream   {g(e['stream'])}  (the largest tensor, or a bucket twice across "
        f"stages)",
        f"  engine reload   {g(e['reload'])}  (a module's streamed tensors vLLM's layer-wise "
        f"reload holds, and its new copy)",
        f"weight sync: each rank receives {g(e['sync_bytes']).strip()} of the stream "
        + SYNC_CUT[e["sync_cut"]]
        + (f"; a replica spans {layout.placement.nodes_per_replica} nodes"
           if layout.placement.nodes_per_replica > 1 else ""),
        "per-GPU memory at each transition of a phase:",
        *[f"  {name:<9} {g(v)}  ({on_device[name]})" for name, v in e["transitions"].items()],
        f"  peak      {g(e['peak'])}  at {e['peak_transition']}, of {gpu_gib:g} GiB "
        f"(a margin of {g(e['margin']).strip()} kept free)",
        f"engine share: rollout.gpu_memory_utilization {r.gpu_memory_utilization:g}; the largest "
        f"each transition with the engine awake allows beside the rest and the margin: "
        + ", ".join(f"{n} {u:.2f}" for n, u in e["engine_share_max"].items())
        + f"; sequences of {cfg.max_sequence_tokens:,} tokens a replica's KV cache holds at "
          f"once: {e['sequences_at_once']:,} at {r.gpu_memory_utilization:g}, "
          f"{e['sequences_at_share_max']:,} at {min(e['engine_share_max'].values()):.2f}"
        + (f" (rollout.max_num_seqs caps it at {r.max_num_seqs})" if r.max_num_seqs else ""),
        f"host memory per node ({e['ranks_per_node']} ranks), pinned: "
        f"{g(e['host_per_node']).strip()} (the learner's offload in "
        f"{g(e['host_learner']).strip()} of 256 MiB chunks a rank, the sleeping engine's "
        f"backups {g(e['host_engine']).strip()} a rank (level 2: its runtime and CUDA-graph "
        f"pools, not its weights), each allocation rounded up to a power of two"
        + (f", the reference policy's weights {g(e['host_reference']).strip()} a rank"
           if e["host_reference"] else "")
        + f"; {g(e['host_unrounded_per_node']).strip()} before rounding)",
        *([f"reference pass: once a phase, over at most {e['reference_tokens']:,} tokens "
           f"(prompts_per_phase x G x the longest sequence): ~{e['reference_seconds']:.0f} s at "
           f"{ASSUMED_MFU:.0%} MFU of {DATASHEET_BF16 / 1e12:.0f} TFLOP/s on each of the "
           f"{world_size} GPUs (a third of a training pass over them)"]
          if e["reference_tokens"] else []),
        *([trajectories(cfg)] if r.tools else []),
        f"learner update: at most {u['flops'] / 1e15:,.0f} PFLOP ({cfg.algo.samples_per_update}"
        f" sequences of {cfg.max_sequence_tokens:,} tokens, attention {u['attention_share']:.0%}"
        f" of a forward, recompute {cfg.model.recompute}), pipeline idle {u['bubble']:.0%} "
        f"({u['microbatches']} microbatches a rank): ~{u['seconds']:.0f} s at "
        f"{ASSUMED_MFU:.0%} MFU of {DATASHEET_BF16 / 1e12:.0f} TFLOP/s on each of the "
        f"{world_size} GPUs (stated rates; every sequence at the longest)",
        "peak with each model.recompute: " + ", ".join(
            f"{c} {v / GIB:.1f} GiB ({RECOMPUTE_COST[c]})" for c, v in e["peak_by_recompute"].items())
        + f"; the cheapest that fits: {e['cheapest_recompute'] or 'none of them'} (this config: "
          f"{cfg.model.recompute})",
    ]
    lines += cost.describe(cfg, spec, world_size, gpus_per_node or world_size,
                           cost.Rates(gpu_gib=gpu_gib))
    if e["peak"] + e["margin"] > gpu_gib * GIB:
        raise ValueError("\n".join(lines) + f"\nthe estimate ({e['peak'] / GIB:.1f} GiB at "
                         f"{e['peak_transition']}, plus the margin) does not fit "
                         f"{gpu_gib:g} GiB per GPU: raise parallel.tensor/pipeline, enable "
                         f"recompute, the distributed optimizer or parallel.offload_learner, or "
                         f"lower rollout.gpu_memory_utilization")
    if e["kv_tokens"] < cfg.max_sequence_tokens:
        raise ValueError("\n".join(lines) + "\nthe engine's KV cache cannot hold one sequence: raise "
                         "rollout.gpu_memory_utilization or rollout.tensor_parallel")
    lines.append("fits: yes")
    return "\n".join(lines)


def stored_checkpoint(cfg: Config, spec) -> str:
    """How a release stored quantized is read (``models.released``), in words: a shard at a
    time, whose float32 working set (the stored values as float32, the block scales spread over
    them, their product: 12 bytes an element beside the stored byte) is the largest linear
    shard's."""
    tp = cfg.parallel.tensor
    mlp = max(spec.ffn_hidden_size, spec.moe_ffn_hidden_size, spec.shared_ffn_hidden_size)
    largest = max([n for _, n in spec.attention_tensors(tp)] + [spec.hidden_size * mlp / tp])
    return (f"checkpoint: stored in {spec.stored.describe()}; each rank reads its shards "
            f"dequantized into {cfg.model.dtype} (the learner trains, syncs and exports "
            f"{cfg.model.dtype}), one tensor at a time: {largest * 13 / GIB:.2f} GiB of host "
            f"memory at most beside the model")


def trajectories(cfg: Config) -> str:
    """What multi-turn rollouts add (``rollout.tools``), in words."""
    r = cfg.rollout
    messages = r.max_turns - 1
    tool_tokens = messages * (r.tool_output_chars // 4 + 32)  # output, and the template's frame
    share = tool_tokens / r.max_new_tokens
    return (f"trajectories: tools {', '.join(r.tools)}; at most {r.max_turns} model turns in the "
            f"{r.max_new_tokens:,} tokens after the prompt, tool messages included, so a sequence "
            f"is still at most {cfg.max_sequence_tokens:,} tokens: up to {messages} tool messages, "
            f"each's output cut to {r.tool_output_chars:,} characters (~{tool_tokens:,} tokens in "
            f"all at 4 characters a token and ~32 of template each: {share:.0%} "
            f"of the budget at most, the loss leaving them out); a "
            f"trajectory waiting on its calls leaves the engine's running batch (its prefix kept "
            f"in the prefix cache), {r.tool_workers} tool processes a replica run them")


def plan(cfg: Config, world_size: int, gpus_per_node: int | None = None,
         hf_config: str | Path | None = None) -> str:
    """The ``plan`` command: the layout (checked) and the schedule in words; with the model's
    config.json (``hf_config``, or model.path's when it is there), what the run would cost,
    GRPO at mu = 4 beside Mu-GRPO (``dryrun.cost``)."""
    source = Path(hf_config) if hf_config else (
        Path(cfg.model.path) if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file()
        else None)
    spec = read_model_spec(source) if source is not None else None
    layout = check_layout(cfg, world_size, gpus_per_node, spec)
    a = cfg.algo
    veto = ("off" if a.veto_threshold is None
            else f"below {a.veto_threshold:g}, scope {a.veto_scope}")
    lines = [
        f"world size {world_size}: TP {cfg.parallel.tensor} x PP {cfg.parallel.pipeline} x DP "
        f"{layout.data_parallel}; {layout.placement.describe()}",
        f"schedule: {describe_schedule(cfg)}",
        f"clip ratio to [{1 - a.clip_low:g}, "
        f"{'auto' if a.clip_high_auto else f'{1 + a.clip_high:g}'}]; veto {veto}"]
    if spec is None:
        lines.append("phase cost: needs the model's config.json (model.path, or --hf-config)")
    else:
        lines += cost.describe(cfg, spec, world_size, gpus_per_node or min(world_size, 8))
    return "\n".join(lines)

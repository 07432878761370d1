"""The phase-cost model: what a run costs in seconds on the user's cluster, GRPO at mu = 4 beside
this config's Mu-GRPO over the same updates and the same generated samples, from stated rates
(``Rates``: every one named, with its source) and the dry run's arithmetic. No GPU has run it.

Both runs make ``algo.total_updates`` updates of ``algo.samples_per_update`` samples, so they
generate the same responses and the learner does the same work; what differs is how often a
phase's fixed costs are paid and how full the engine runs:

- **sync** (once a phase): the bytes one rank receives (``memory.sync_bytes``: the sync plan's
  cut) over the slowest link its stream crosses (the fabric when the learner's pipeline stages,
  its experts or a replica span nodes, NVLink otherwise), plus an offloaded learner's read of
  its own shard from its host copy over PCIe;
- **switch** (once a phase): the learner's state to the host and back (``parallel.offload_learner``)
  and the engine's pools backed up and restored (level-2 sleep), over PCIe, plus a fixed
  wake/sleep allowance;
- **generate**: per replica, its share of the phase's responses decoded at the concurrency its KV
  cache and ``max_num_seqs`` allow; a decode step reads the engine's weights (for a mixture of
  experts, the experts a batch's tokens reach) and every running sequence's KV from HBM, or is
  compute bound, whichever is slower, plus a step's fixed overhead and its tensor-parallel
  all-reduces' latency; a phase ends with its longest response (``Rates.tail_tokens``, the cap:
  some response of a phase reaches it), so a phase of few responses is as long as the longest
  one alone, and a phase of many drains its last batch (taken at half the concurrency) for the
  longest's length beyond the mean. Prefill: the prompts once a group (prefix caching), compute
  bound;
- **score**: the reward's seconds a response over ``reward.num_workers``, streamed beside the
  generation: only what outlasts the generation counts;
- **reference**: with a KL term to a reference (or ``Rates.logprob_passes``: a peer's recomputed
  old log-probs), a no-grad forward over the phase's tokens at ``Rates.train_mfu``;
- **learner**: ``compute.update_seconds`` at the mean sequence length (every update the same in
  both runs).

Left out, equal in both runs or small: checkpoint saves (same updates), held-out evaluation,
tool calls' own time, the data path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from mugrpo_megatron.config import Config
from mugrpo_megatron.dryrun.compute import forward_flops, update_seconds
from mugrpo_megatron.dryrun.memory import BYTES, DATASHEET_BF16, H100_GIB, EngineTensors, estimate
from mugrpo_megatron.layout import check_layout
from mugrpo_megatron.models.hf_config import ModelSpec

GRPO_MU = 4
"""GRPO's updates a phase in the paper (1024 refreshes of 4096 updates)."""
PAPER_MU = 1024
"""Mu-GRPO's updates a phase in the paper: the other side when the config itself is GRPO's."""


@dataclass(frozen=True)
class Rates:
    """The model's inputs: each a rate or share with its source. ``RANGES`` gives the spread each
    uncertain one is varied over for the ratio's range."""

    gpu_gib: float = H100_GIB
    """Memory a GPU as CUDA reports it (the dry run's --gpu-gib): what the KV cache gets."""
    hbm_bytes_per_s: float = 3.35e12
    """H100 SXM HBM3 bandwidth (NVIDIA's datasheet)."""
    hbm_efficiency: float = 0.7
    """The share of it a decode step's reads reach (assumed: vLLM's decode kernels reach 60-80%
    in published roofline measurements; varied 0.5-0.85)."""
    peak_flops: float = DATASHEET_BF16
    """H100 SXM dense bf16 FLOP/s (NVIDIA's datasheet)."""
    train_mfu: float = 0.4
    """Model FLOPs utilisation of the learner's forward and backward (assumed, as the dry run's
    ``ASSUMED_MFU``; Megatron-core reports 35-47% on H100 for dense models, MoE lower; varied
    0.25-0.5)."""
    decode_mfu: float = 0.5
    """The compute ceiling of a decode step and of prefill (assumed; varied 0.35-0.6)."""
    nvlink_bytes_per_s: float = 360e9
    """What one GPU sends or receives over NVLink 4 in a collective (nccl-tests' bus bandwidth on
    DGX H100, ~360-450 GB/s of the 450 GB/s a direction)."""
    fabric_bytes_per_s: float = 40e9
    """What one GPU sends or receives across nodes: a 400 Gb/s NIC a GPU (DGX H100's 8 x
    ConnectX-7) at ~80% (nccl-tests' inter-node bus bandwidth; varied 20-45 GB/s)."""
    pcie_bytes_per_s: float = 50e9
    """Pinned host <-> device copies over PCIe Gen5 x16 (64 GB/s a direction; ~50 measured)."""
    step_overhead_s: float = 0.003
    """A decode step's fixed cost beside its reads: scheduling, sampling, launches with CUDA
    graphs (assumed; vLLM V1 reports a few ms a step at large batches; varied 1-6 ms)."""
    allreduce_latency_s: float = 15e-6
    """One small all-reduce inside a node (nccl-tests' latency on NVLink; two a layer a decode
    step under TP)."""
    cross_node_latency_s: float = 40e-6
    """The same across nodes (InfiniBand), when a replica spans nodes."""
    wake_sleep_s: float = 2.0
    """An engine's wake and sleep a phase beyond the bytes moved: mapping and unmapping its
    memory, resetting its cache (assumed; varied 0.5-10 s)."""
    score_s_per_response: float = 0.05
    """The reward's seconds a response on one worker (math-verify's parse and compare: tens of
    ms; a code or tool reward far more)."""
    mean_length_fraction: float = 0.5
    """Mean response length as a share of rollout.max_new_tokens (assumed; NeMo-RL's published
    runs show 0.46 at DeepSeek-V3 1.5k and 0.70 at Qwen3-235B 8k; varied 0.3-0.8)."""
    prompt_fraction: float = 0.25
    """Mean prompt length as a share of data.max_prompt_tokens (assumed; math problems run
    100-300 tokens of a 1024 cap)."""
    tail_tokens: int = 0
    """The longest response of a replica's phase; 0: rollout.max_new_tokens (reasoning runs cap
    some responses every step)."""
    decode_step_scale: float = 1.0
    """A decode step's time over the roofline above (1: the roofline). ``benchmarks/phase_cost.py``
    reports what peers' published step times imply (2-5x at replicas spanning nodes)."""
    logprob_passes: int = 0
    """No-grad forwards over a phase's tokens beside the reference's: 0 here (the behaviour's
    log-probs come from the engine); 1 for a peer that recomputes them (NeMo-RL, verl)."""


RANGES = {
    "hbm_efficiency": (0.5, 0.85),
    "train_mfu": (0.25, 0.5),
    "decode_mfu": (0.35, 0.6),
    "fabric_bytes_per_s": (20e9, 45e9),
    "step_overhead_s": (0.001, 0.006),
    "wake_sleep_s": (0.5, 10.0),
    "mean_length_fraction": (0.3, 0.8),
}
"""The uncertain inputs and the spread each is varied over (their sources in ``Rates``)."""


@dataclass(frozen=True)
class PhaseCost:
    """One phase's seconds by term, and how the engine ran."""

    sync: float
    switch: float
    generate: float
    score: float
    reference: float
    learner: float
    """The phase's updates."""
    concurrency: int
    """Sequences a replica decodes at once."""
    decode_steps: float
    """Decode steps a replica runs in the phase."""
    step_seconds: float
    """One decode step at that concurrency."""

    @property
    def total(self) -> float:
        return self.sync + self.switch + self.generate + self.score + self.reference + self.learner


@dataclass(frozen=True)
class RunCost:
    """A run of ``phases`` phases of ``mu`` updates."""

    mu: int
    phases: int
    responses_per_phase: int
    phase: PhaseCost

    @property
    def seconds(self) -> float:
        return self.phases * self.phase.total

    def term(self, name: str) -> float:
        return self.phases * getattr(self.phase, name)


def with_mu(cfg: Config, mu: int) -> Config:
    """``cfg`` at ``mu`` updates a phase, its samples a phase scaled to match (the same updates
    and samples a run)."""
    a = cfg.algo
    samples = mu * a.samples_per_update
    prompts = max(1, math.ceil(samples / cfg.rollout.group_size))
    return dataclasses.replace(cfg, algo=dataclasses.replace(
        a, updates_per_phase=mu, prompts_per_phase=prompts, max_drift=None))


def decode_step_seconds(spec: ModelSpec, cfg: Config, batch: float, context: float,
                        rates: Rates, nodes_per_replica: int) -> float:
    """One decode step of a replica at ``batch`` running sequences of mean ``context`` tokens:
    the slower of its HBM reads and its compute on one engine GPU, plus the step's overhead and
    its TP all-reduces' latency."""
    r, tp = cfg.rollout, cfg.rollout.tensor_parallel
    fp8 = r.quantization == "fp8"
    weights = EngineTensors.of(spec, tp, cfg.model.dtype, fp8).total
    if spec.is_moe:  # the experts no token of the step reaches are not read
        per_byte = (1 + 4 / (128 * 128)) if fp8 else BYTES[cfg.model.dtype]
        moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
        experts = moe_layers * spec.num_experts * 3 * spec.moe_ffn_hidden_size \
            * spec.hidden_size / tp * per_byte
        reached = 1 - (1 - spec.experts_per_token / spec.num_experts) ** max(batch, 1)
        weights -= experts * (1 - reached)
    kv_token = spec.num_layers * spec.kv_cache_values(tp) * (
        1 if r.kv_cache_dtype.startswith("fp8") else 2)
    read = weights + batch * context * kv_token
    memory = read / (rates.hbm_bytes_per_s * rates.hbm_efficiency)
    gemm, _ = forward_flops(spec, 1)
    attention = 2 * spec.num_layers * context * spec.num_heads * (spec.head_dim + spec.v_head_dim)
    compute = batch * (gemm + attention) / tp / (rates.peak_flops * rates.decode_mfu)
    latency = rates.cross_node_latency_s if nodes_per_replica > 1 else rates.allreduce_latency_s
    collectives = 2 * spec.num_layers * latency if tp > 1 else 0.0
    return (max(memory, compute) + rates.step_overhead_s + collectives) * rates.decode_step_scale


def phase_cost(cfg: Config, spec: ModelSpec, world: int, gpus_per_node: int,
               rates: Rates) -> PhaseCost:
    """One phase of ``cfg`` (its updates_per_phase and prompts_per_phase) on ``world`` GPUs."""
    a, r, p = cfg.algo, cfg.rollout, cfg.parallel
    layout = check_layout(cfg, world, gpus_per_node, spec)
    e = estimate(cfg, spec, layout.data_parallel, rates.gpu_gib, gpus_per_node)
    place = layout.placement
    # sync: the slowest link the stream crosses, and an offloaded learner's host read
    crosses = world > gpus_per_node and (p.pipeline > 1 or place.nodes_per_replica > 1
                                         or p.tensor * p.expert > gpus_per_node)
    link = rates.fabric_bytes_per_s if crosses else rates.nvlink_bytes_per_s
    sync = e["sync_bytes"] / link
    if e["offloaded"]:
        sync += e["params"] / rates.pcie_bytes_per_s
    # switch: the learner's state out and back, the engine's pools out and back, wake and sleep
    moved = (2 * (e["params"] + e["optimizer"]) if e["offloaded"] else 0.0) \
        + (2 * e["host_engine"] if r.sleep_between_phases else 0.0)
    switch = moved / rates.pcie_bytes_per_s + (rates.wake_sleep_s if r.sleep_between_phases
                                               else 0.0)
    # generate: a replica's share at the concurrency its KV cache allows
    responses = a.prompts_per_phase * r.group_size
    share = responses / place.replicas
    mean = rates.mean_length_fraction * r.max_new_tokens
    prompt = rates.prompt_fraction * cfg.data.max_prompt_tokens
    tail = rates.tail_tokens or r.max_new_tokens
    context = prompt + mean / 2  # a sequence's mean context over its decode steps
    seqs_cap = r.max_num_seqs or 1024  # vLLM 0.32's default on H100
    concurrency = max(1, min(seqs_cap, int(e["kv_tokens"] // context)))
    if share <= concurrency:  # one wave: the phase lasts as long as its longest response
        steps, batch = float(tail), share * mean / tail
        decode = steps * decode_step_seconds(spec, cfg, batch, context, rates,
                                             place.nodes_per_replica)
        step = decode / steps
    else:  # full batches, then the last admitted drain to the longest (the thinning batch
        # taken at half the concurrency)
        full = share * mean / concurrency
        step = decode_step_seconds(spec, cfg, concurrency, context, rates, place.nodes_per_replica)
        drain = max(0.0, tail - mean) * decode_step_seconds(
            spec, cfg, concurrency / 2, context, rates, place.nodes_per_replica)
        steps, decode = full + max(0.0, tail - mean), full * step + drain
    gemm, _ = forward_flops(spec, 1)
    prefill = (share / r.group_size) * prompt * gemm / r.tensor_parallel \
        / (rates.peak_flops * rates.decode_mfu)
    generate = decode + prefill
    # score: streamed beside the generation; what outlasts it counts
    scoring = responses * rates.score_s_per_response / (cfg.reward.num_workers * place.replicas)
    score = max(0.0, scoring - generate)
    # reference and recomputed log-probs: no-grad forwards over the phase's tokens
    passes = rates.logprob_passes + int(bool(a.kl_coef) and a.kl_target == "reference")
    seq = prompt + mean
    fwd_gemm, fwd_core = forward_flops(spec, int(seq))
    reference = passes * responses * (fwd_gemm + fwd_core) / (world * rates.train_mfu
                                                              * rates.peak_flops)
    u = update_seconds(cfg, spec, layout.data_parallel, world, seq=int(seq), mfu=rates.train_mfu,
                       peak=rates.peak_flops)
    return PhaseCost(sync=sync, switch=switch, generate=generate, score=score,
                     reference=reference, learner=a.updates_per_phase * u["seconds"],
                     concurrency=concurrency, decode_steps=steps, step_seconds=step)


def run_cost(cfg: Config, spec: ModelSpec, world: int, gpus_per_node: int,
             rates: Rates) -> RunCost:
    a = cfg.algo
    phases = math.ceil(a.total_updates / a.updates_per_phase)
    return RunCost(mu=a.updates_per_phase, phases=phases,
                   responses_per_phase=a.prompts_per_phase * cfg.rollout.group_size,
                   phase=phase_cost(cfg, spec, world, gpus_per_node, rates))


def compare(cfg: Config, spec: ModelSpec, world: int, gpus_per_node: int,
            rates: Rates = Rates()) -> tuple[RunCost, RunCost]:
    """(GRPO at mu = 4, Mu-GRPO) over the config's updates and samples: the config's own mu for
    Mu-GRPO, or the paper's 1024 (at most the run's updates) when the config is GRPO's."""
    a = cfg.algo
    mu = a.updates_per_phase if a.updates_per_phase > GRPO_MU else divisor(a.total_updates,
                                                                             PAPER_MU)
    return (run_cost(with_mu(cfg, divisor(a.total_updates, GRPO_MU)), spec, world,
                     gpus_per_node, rates),
            run_cost(with_mu(cfg, mu), spec, world, gpus_per_node, rates))


def divisor(total: int, at_most: int) -> int:
    """The largest mu of at most ``at_most`` that divides a run's ``total`` updates (the config
    requires whole phases): 4 for GRPO where it divides, else the nearest below."""
    return max(d for d in range(1, min(total, at_most) + 1) if total % d == 0)


def ratio_range(cfg: Config, spec: ModelSpec, world: int, gpus_per_node: int,
                rates: Rates = Rates()) -> tuple[float, float]:
    """The least and the most GRPO / Mu-GRPO over every corner of ``RANGES``."""
    ratios = []
    names = list(RANGES)
    for corner in itertools.product(*(RANGES[n] for n in names)):
        at = dataclasses.replace(rates, **dict(zip(names, corner)))
        grpo, mu = compare(cfg, spec, world, gpus_per_node, at)
        ratios.append(grpo.seconds / mu.seconds)
    return min(ratios), max(ratios)


TERMS = ("sync", "switch", "generate", "score", "reference", "learner")


def describe(cfg: Config, spec: ModelSpec, world: int, gpus_per_node: int,
             rates: Rates = Rates()) -> list[str]:
    """The comparison in words: a row a run, its terms in hours (seconds for a run of under
    two), the ratio and its range, and the assumptions."""
    grpo, mu = compare(cfg, spec, world, gpus_per_node, rates)
    low, high = ratio_range(cfg, spec, world, gpus_per_node, rates)
    unit, per = ("hours", 3600) if grpo.seconds >= 7200 else ("seconds", 1)
    h = lambda s: f"{s / per:9.1f}"  # noqa: E731
    lines = [f"phase cost (stated rates, not measured; dryrun/cost.py): "
             f"{cfg.algo.total_updates} updates of {cfg.algo.samples_per_update} samples either "
             f"way, {unit} on {world} GPUs ({gpus_per_node} a node)",
             "  run              phases  responses/phase " + "".join(f"{t:>10}" for t in TERMS)
             + "     total"]
    for name, run in ((f"GRPO mu={grpo.mu}", grpo), (f"Mu-GRPO mu={mu.mu}", mu)):
        lines.append(f"  {name:<16} {run.phases:>6} {run.responses_per_phase:>16,} "
                     + "".join(h(run.term(t)) + " " for t in TERMS) + h(run.seconds))
    for name, run in (("GRPO", grpo), ("Mu-GRPO", mu)):
        lines.append(f"  {name}: a replica decodes {run.phase.concurrency:,} sequences at once, "
                     f"{run.phase.decode_steps:,.0f} steps a phase of "
                     f"{run.phase.step_seconds * 1e3:.1f} ms")
    lines.append(f"  Mu-GRPO is {grpo.seconds / mu.seconds:.2f}x faster than GRPO mu={grpo.mu} "
                 f"(generation {grpo.term('generate') / max(mu.term('generate'), 1e-9):.2f}x); "
                 f"{low:.2f}x-{high:.2f}x over " + ", ".join(
                     f"{n} {lo:g}-{hi:g}" for n, (lo, hi) in RANGES.items()))
    lines.append("  assumptions: " + "; ".join(
        f"{f.name} {getattr(rates, f.name):g}" for f in dataclasses.fields(rates)))
    return lines

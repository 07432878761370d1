"""The job's layout, checked once, before any process group exists.

- ``check_layout``: the learner's parallel sizes against the world size and the minibatch, where
  the rollout engines run (``placement``), and, given the model's ``ModelSpec``, the model
  (``check_model``: heads over TP, experts over EP, layers over the pipeline stages, sequence
  parallel for a mixture of experts at TP > 1, FP8's GEMM shapes, the context-parallel exchange:
  ``context``). ``train``, ``train --dry-run``
  and ``plan`` call it first, ``convert`` calls its parts that apply to a conversion
  (``check_conversion``: the world size and ``check_model``), and the learner calls
  ``check_model`` before it builds: one check, so a layout the dry run passes is one the learner
  builds.
- ``Placement`` (``placement``): which ranks host an engine, which replica each rank belongs to
  and which rank leads it; the fleet, ``plan`` and the dry run read it instead of working it out.
- ``shapes``: the pure rules of tensor shapes (rounding, FP8's GEMM shapes, the token multiple of
  a microbatch row, the tokens of a packed row), which the learner and the dry run both follow.

No megatron and no process group here: every error names the key or flag and the value, and
comes before any rank waits for another or builds anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from mugrpo_megatron.config import Config, ModelConfig, ParallelConfig
from mugrpo_megatron.layout.context import check_packing, context_comm_type, packs_with
from mugrpo_megatron.layout.placement import Placement, launcher_ranks_per_node, placement
from mugrpo_megatron.layout.shapes import (
    check_model_dims,
    engine_fp8_problem,
    gemm_inputs_ok,
    pack_capacity,
    round_up,
    token_multiple,
)
from mugrpo_megatron.models.hf_config import ModelSpec

__all__ = ["JobLayout", "Placement", "check_conversion", "check_layout", "check_model",
           "context_comm_type", "gemm_inputs_ok", "launcher_ranks_per_node", "pack_capacity",
           "packs_with", "placement", "round_up", "token_multiple"]


@dataclass(frozen=True)
class JobLayout:
    """What ``check_layout`` found: the data-parallel size and the engines' placement."""

    data_parallel: int
    placement: Placement


def check_layout(cfg: Config, world_size: int, ranks_per_node: int | None = None,
                 spec: ModelSpec | None = None) -> JobLayout:
    """Validate the job's layout for ``world_size`` processes, ``ranks_per_node`` of them a node
    when known, and with ``spec`` the model's; ValueError naming the key and the value."""
    p = cfg.parallel
    dp = p.data_parallel(world_size)
    where = placement(cfg.rollout, world_size, ranks_per_node)
    per_step = dp * p.micro_batch_size
    if cfg.algo.samples_per_update % per_step:
        raise ValueError(
            f"algo.samples_per_update: {cfg.algo.samples_per_update} is not divisible by "
            f"data-parallel size x parallel.micro_batch_size = {dp} x {p.micro_batch_size} at "
            f"world size {world_size}")
    if spec is not None:
        check_model(spec, cfg.model, p)
        if cfg.rollout.quantization == "fp8" and (
                problem := engine_fp8_problem(spec, cfg.rollout.tensor_parallel)):
            raise ValueError(f"rollout.quantization: fp8: {spec.architecture}'s {problem}")
        if spec.stored is not None and cfg.rollout.engine == "sglang":
            raise ValueError(
                f"rollout.engine: sglang: model.path is stored in {spec.stored.describe()}, which "
                f"the learner reads dequantized; starting SGLang on it with the model's own "
                f"layers is not done here yet: use rollout.engine: vllm, or start from a bf16 "
                f"copy (convert --to megatron, then --to hf)")
    return JobLayout(dp, where)


def check_conversion(spec: ModelSpec, model: ModelConfig, *, tp: int, pp: int, ep: int,
                     world_size: int) -> ParallelConfig:
    """The layout ``convert`` builds ``model`` in: TP x PP x EP over ``world_size`` ranks, checked
    as ``check_layout`` checks a run's (the world size, then ``check_model``). A mixture of
    experts at TP > 1 gets sequence parallel, which megatron-core needs for it and which changes
    no weight; no optimizer, so no distributed optimizer."""
    parallel = ParallelConfig(tensor=tp, pipeline=pp, expert=ep,
                              sequence_parallel=(spec.is_moe or spec.mla is not None) and tp > 1,
                              distributed_optimizer=False)
    parallel.data_parallel(world_size)
    check_model(spec, model, parallel)
    return parallel


def check_model(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig) -> None:
    """The layout's requirements of the model itself (see the module docstring)."""
    spec.check_tensor_parallel(parallel.tensor)
    spec.check_expert_parallel(parallel.expert)
    if not spec.is_moe:
        for key, value, default in (("router_dtype", model.router_dtype, "fp32"),
                                    ("router_load_balancing", model.router_load_balancing, "none"),
                                    ("freeze_router", model.freeze_router, False)):
            if value != default:
                raise ValueError(f"model.{key}: {value!r} needs a mixture-of-experts model; "
                                 f"{spec.architecture} is dense")
    if spec.is_moe and parallel.context > 1 and model.router_load_balancing != "none":
        # the experts and the policy loss under CP equal CP1 (tests/test_learner.py, GLM-4.5,
        # Qwen3-MoE, Mixtral at CP2 and EP2 x CP2); megatron-core 0.16.1's load-balancing loss
        # does not: at CP2 its update's gradient norm was 5.286 against CP1's 5.278
        raise ValueError(f"model.router_load_balancing: {model.router_load_balancing!r} with "
                         f"parallel.context > 1 gives other gradients than at context 1 "
                         f"(megatron-core's load-balancing loss over context-parallel chunks); "
                         f"use 'none' (NeMo-RL's and slime's RL setting) or parallel.context: 1")
    if spec.is_moe and parallel.tensor > 1 and not parallel.sequence_parallel:
        raise ValueError("parallel.sequence_parallel: megatron-core needs it for a "
                         "mixture-of-experts model with parallel.tensor > 1")
    if spec.mla is not None and parallel.tensor > 1 and not parallel.sequence_parallel:
        # megatron-core 0.16.1-0.19.2 MLA: the shared rotary key reaches every TP rank's heads
        # through gather_from_sequence_parallel_region, whose backward sums its gradient over
        # TP; without sequence parallel nothing sums it (each rank keeps its heads' part)
        raise ValueError("parallel.sequence_parallel: multi-latent attention with "
                         "parallel.tensor > 1 needs it (megatron-core sums the shared rotary "
                         "key's gradient over TP only there)")
    if spec.mla is not None and parallel.context > 1:
        raise ValueError("parallel.context: context parallelism with multi-latent attention "
                         "is not implemented yet; use parallel.context: 1")
    check_packing(spec, parallel)  # and the context-parallel exchange (layout.context)
    stages = parallel.pipeline * (parallel.virtual_pipeline or 1)
    if spec.num_layers % stages:
        raise ValueError(f"parallel.pipeline x virtual_pipeline = {stages} does not divide the "
                         f"{spec.num_layers} layers of the model")
    if model.fp8_format is not None:
        check_model_dims(spec, parallel)

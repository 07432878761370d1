"""vLLM backend: in-process ``LLM`` with behaviour log-probs and in-place weight reload.

The engine always runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weights
pass from the learner as tensors, on the same device, without serialised copies (a generator of
tensors cannot even cross to another process). Two placements (``rollout.placement``):

- spmd: every torchrun rank builds an ``LLM`` with vLLM's external launcher, which makes its
  process groups over the learner's world (ranks ``[r * tp, (r + 1) * tp)`` are replica ``r``'s
  tensor-parallel group); ``engines.fleet`` gives each replica its share of the prompts.
- rank0: global rank 0 alone builds a one-rank engine inside a private one-rank world: vLLM
  creates its process groups collectively over what it believes is the whole world, and the other
  learner ranks never join, so while it builds it is told the world has one rank.

On GPUs vLLM's sleep mode (level 1: weights offloaded, KV cache dropped) runs between phases.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines.base import (
    Generation,
    RolloutEngine,
    SamplingSpec,
    WeightSyncStats,
    torch_state_kept,
)


@contextlib.contextmanager
def _learner_world(private: bool) -> Iterator[None]:
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


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's layer-wise reload warns "<layer>: Failed to load weights" for every layer that
    received no tensor. Two such layers are expected on every sync and need nothing: the rotary
    embedding (a computed cache, in no checkpoint) and the LM head of a tied model (its weight is
    the embedding's, which is loaded, and ``_refresh_tied_lm_head`` rebuilds the head from it).
    Any other layer's warning is kept; a wrong or missing weight also shows in the mismatch check."""

    EXPECTED = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.EXPECTED


def _refresh_tied_lm_head(worker) -> bool:
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


def _repack_cpu_experts(worker) -> int:
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


class VLLMEngine(RolloutEngine):
    def __init__(self, cfg: RolloutConfig, model_dir: str | Path, *, dtype: str, max_model_len: int,
                 trust_remote_code: bool = False, spmd: bool = False):
        on_gpu = torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: see the module docstring
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cfg.cpu_kv_cache_gib)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _ExpectedReloadWarnings())

        kwargs = dict(model=str(model_dir), dtype=dtype, seed=cfg.seed, max_model_len=max_model_len,
                      tensor_parallel_size=cfg.tensor_parallel, trust_remote_code=trust_remote_code,
                      enforce_eager=not on_gpu, logprobs_mode="processed_logprobs")
        if spmd:
            kwargs.update(distributed_executor_backend="external_launcher")
        if on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization,
                          enable_sleep_mode=cfg.sleep_between_phases)
        else:
            # A prompt prefilled in chunks makes vLLM rewind its per-request generator, which a
            # CPU generator cannot do ("CPU Generator does not use offset"): prefill whole prompts.
            kwargs.update(enable_chunked_prefill=False)
        self._spmd = spmd
        with _learner_world(private=not spmd), torch_state_kept():
            self.llm = LLM(**kwargs)
        self.supports_sleep = on_gpu and cfg.sleep_between_phases
        self._broken = ""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
                 ) -> list[list[Generation]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._broken:
            raise RuntimeError(f"the engine's weights are undefined since an update failed "
                               f"({self._broken}); restart the engine")
        def params(i: int) -> SamplingParams:
            # vLLM seeds the j-th of the n samples with seed + j: prompts n apart never share one
            seed = None if sampling.seed is None else sampling.seed + i * sampling.n
            return SamplingParams(n=sampling.n, max_tokens=sampling.max_new_tokens,
                                  temperature=sampling.temperature, top_p=sampling.top_p,
                                  top_k=sampling.top_k if sampling.top_k > 0 else 0,
                                  seed=seed, logprobs=0)

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    [params(i) for i in range(len(prompts))], use_tqdm=False)
        result = []
        for out in outputs:
            gens = []
            for c in out.outputs:
                ids = tuple(int(t) for t in c.token_ids)
                lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, ids))
                gens.append(Generation(ids, lps, "length" if c.finish_reason == "length" else "stop"))
            result.append(gens)
        return result

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        counted = {"tensors": 0, "bytes": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                counted["tensors"] += 1
                counted["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        if self._broken:
            raise RuntimeError(f"the engine's weights are undefined since an update failed "
                               f"({self._broken}); restart the engine")
        t0 = time.perf_counter()
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        except Exception as e:
            # vLLM reloads layer by layer from meta tensors; an update that fails part way leaves
            # the model half-loaded, so refuse to generate with it.
            self._broken = f"{type(e).__name__}: {e}"
            raise
        self.llm.collective_rpc(_refresh_tied_lm_head)
        if not torch.cuda.is_available():
            self.llm.collective_rpc(_repack_cpu_experts)
        self.llm.reset_prefix_cache()
        return WeightSyncStats(counted["tensors"], counted["bytes"], time.perf_counter() - t0)

    def _release_memory(self) -> set[str]:
        self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
        return {"weights", "kv_cache"}

    def _resume_memory(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        import gc

        with _learner_world(private=not self._spmd):
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del self.llm
            gc.collect()

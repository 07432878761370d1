"""SGLang backend: ``sglang.Engine`` with behaviour log-probs and in-place weight updates.

The engine runs its scheduler in its own processes (SGLang always does); one is created on each
node's first rank (``rollout.placement`` node, the default) or on global rank 0 alone (rank0).
Weights arrive as (HF name, tensor) and are handed to ``update_weights_from_tensor`` in buckets
inside ``begin_weight_update()`` / ``end_weight_update()`` (which lets SGLang finalise quantized or
repacked weights once), then the radix (prefix) cache is flushed. On a GPU the tensors travel as
CUDA IPC handles; on CPU they are serialised through shared memory.

CPU: SGLang runs on plain torch with ``SGLANG_USE_CPU_ENGINE=1`` and ``device="cpu"`` (set here
when there is no GPU); ``scripts/setup_sglang_env.sh`` builds an environment for it. It reports
log-probs of the tempered distribution it samples from (softmax(logits / T)), as the learner
computes them, unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which this backend refuses.
Per-request seeds are honoured by SGLang only in its deterministic mode, so sampling here is
seeded once per engine (``rollout.seed`` plus the node's index), not per request: a resumed phase
or another number of nodes draws other samples for the groups it generates, unlike vLLM.

GPU: ``enable_memory_saver`` lets ``sleep()`` release weights and KV cache
(``release_memory_occupation``) while the learner trains, and ``wake()`` take them back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines.base import Generation, RolloutEngine, SamplingSpec, WeightSyncStats
from mugrpo_megatron.engines.compat_torch import torch_state_kept
from mugrpo_megatron.models import read_model_spec

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _cpu_kv_tokens(model_dir: Path, dtype: str, gib: float) -> int:
    """How many tokens of KV cache fit in ``gib`` GiB (SGLang's CPU engine sizes its cache in
    tokens)."""
    spec = read_model_spec(model_dir)
    per_token = spec.num_layers * spec.kv_cache_values(1) * _DTYPE_BYTES[dtype]
    return max(1, int(gib * 2**30 // per_token))


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the HF checkpoint the engine loaded (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


class SGLangEngine(RolloutEngine):
    def __init__(self, cfg: RolloutConfig, model_dir: str | Path, *, dtype: str, max_model_len: int,
                 trust_remote_code: bool = False, load_weights: bool = True,
                 timeout_minutes: float | None = None):
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report log-probs "
                             "of the untempered logits, not of the distribution it samples from, "
                             "and every ratio would be off. Unset it.")
        import sglang

        kwargs = dict(model_path=str(model_dir), dtype=dtype, random_seed=cfg.seed,
                      tp_size=cfg.tensor_parallel, context_length=max_model_len,
                      trust_remote_code=trust_remote_code, skip_tokenizer_init=True,
                      log_level=os.environ.get("SGLANG_LOG_LEVEL", "warning"))
        if not load_weights:  # random placeholders; the first sync writes every weight
            kwargs.update(load_format="dummy")
        if cfg.max_num_seqs:
            kwargs.update(max_running_requests=cfg.max_num_seqs)
        if timeout_minutes is not None:  # its scheduler processes' own process groups
            kwargs.update(dist_timeout=max(1, round(timeout_minutes * 60)))
        if on_gpu:
            kwargs.update(mem_fraction_static=cfg.gpu_memory_utilization,
                          enable_memory_saver=cfg.sleep_between_phases)
        else:
            kwargs.update(device="cpu", disable_cuda_graph=True,
                          max_total_tokens=_cpu_kv_tokens(Path(model_dir), dtype,
                                                          cfg.cpu_kv_cache_gib))
        with torch_state_kept():
            self.engine = sglang.Engine(**kwargs)
        self.supports_sleep = on_gpu and cfg.sleep_between_phases
        # released without a CPU backup (SGLang's enable_weights_cpu_backup defaults to off)
        self.sleep_discards_weights = self.supports_sleep
        self._bucket_bytes = cfg.weight_bucket_mb << 20
        # SGLang's scheduler dies on a tensor of the wrong shape and takes this process with it
        # (SIGQUIT to its parent); check each tensor against the checkpoint first and refuse.
        self._shapes = _checkpoint_shapes(Path(model_dir))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
                 ) -> list[list[Generation]]:
        # One request per sample, G in a row per prompt: answers come back in request order.
        # (SGLang's own n > 1 repeats the whole batch n times, sample-major.) The radix cache
        # shares each prompt's prefill among its G requests.
        requests = [list(map(int, p)) for p in prompts for _ in range(sampling.n)]
        gens = self._run(requests, sampling, [sampling.max_new_tokens] * len(requests))
        return [gens[k:k + sampling.n] for k in range(0, len(gens), sampling.n)]

    def step_turns(self) -> list[tuple[int, Generation]]:
        """Every queued turn in one batch (SGLang has no step API here), each its own length;
        seeds are the engine's (see the module docstring)."""
        todo, self._turns = self._turns or [], []
        if not todo:
            return []
        gens = self._run([list(map(int, r.token_ids)) for r in todo], self._turn_sampling,
                         [r.max_new_tokens for r in todo])
        return [(r.key, g) for r, g in zip(todo, gens)]

    def _run(self, requests: list[list[int]], sampling: SamplingSpec, lengths: list[int]
             ) -> list[Generation]:
        params = [{"max_new_tokens": n, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "top_k": sampling.top_k} for n in lengths]
        outputs = self.engine.generate(input_ids=requests, sampling_params=params,
                                       return_logprob=True)
        result: list[Generation] = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            ids = tuple(int(t) for t in out["output_ids"])
            steps = meta["output_token_logprobs"]
            if [int(s[1]) for s in steps] != list(ids):
                raise RuntimeError(f"SGLang returned log-probs for other tokens than it sampled "
                                   f"(request {i})")
            reason = meta.get("finish_reason") or {}
            finish = "length" if reason.get("type") == "length" else "stop"
            result.append(Generation(ids, tuple(float(s[0]) for s in steps), finish))
        return result

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        t0 = time.perf_counter()
        tensors = nbytes = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0

        def flush() -> None:
            nonlocal bucket, size
            if bucket:
                ok, message = self.engine.update_weights_from_tensor(bucket, flush_cache=False)
                if not ok:
                    raise RuntimeError(f"SGLang refused the weights "
                                       f"{bucket[0][0]}..{bucket[-1][0]}: {message}")
            bucket, size = [], 0

        self.engine.begin_weight_update()
        try:
            for name, tensor in weights:
                self._check(name, tensor)
                bucket.append((name, tensor))
                n = tensor.numel() * tensor.element_size()
                size += n
                nbytes += n
                tensors += 1
                if size >= self._bucket_bytes:
                    flush()
            flush()
        finally:
            self.engine.end_weight_update()
        self.engine.flush_cache()
        return WeightSyncStats(tensors, nbytes, time.perf_counter() - t0)

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if not self._shapes:
            return  # not a safetensors checkpoint: nothing to check against
        want = self._shapes.get(name)
        if want is None and name == "lm_head.weight":
            want = self._shapes.get("model.embed_tokens.weight")  # tied in the checkpoint
        if want is None:
            raise ValueError(f"weight {name!r} is not in the engine's checkpoint")
        if tuple(tensor.shape) != want:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the engine's "
                             f"checkpoint {want} (a padded vocabulary or a wrong split?)")

    def _release_memory(self) -> set[str]:
        self.engine.release_memory_occupation()  # every type: weights, KV cache, CUDA graphs
        return {"weights", "kv_cache", "cuda_graph"}

    def _resume_memory(self, tags: list[str]) -> None:
        self.engine.resume_memory_occupation(tags=tags)

    def shutdown(self) -> None:
        self.engine.shutdown()

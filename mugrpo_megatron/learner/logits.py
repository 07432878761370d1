"""Per-token log-probs and entropy from the last stage's output, each tensor-parallel rank
holding its shard of the vocabulary: nothing gathers the vocabulary, and nothing copies the
logits beyond what megatron's vocab-parallel cross entropy needs. The memory this takes is the
dry run's ``logits_bytes`` (checked on CPU by tests/test_memory.py)."""

from __future__ import annotations

import mugrpo_megatron.learner.compat_megatron  # noqa: F401 - before megatron-core (its part 6)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

PAD_LOGIT = -1e30
"""Padded vocabulary entries: exp() of it is 0, and 0 * it is not NaN."""
ENTROPY_CHUNK = 1 << 26
"""Logits the entropy exponentiates at a time (256 MB in fp32)."""


def policy_logits(logits_bsv: torch.Tensor, temperature: float, vocab_size: int,
                  tp_rank: int) -> torch.Tensor:
    """fp32 logits of this TP rank's vocabulary shard as the engine samples them: divided by the
    temperature, the padded vocabulary entries (beyond ``vocab_size``) set to ``PAD_LOGIT``. In
    place where the model's output is fp32 already (megatron's ``Float16Module`` hands the last
    stage's output over in fp32, and the fp32 model's is its own): no copy at temperature 1, one
    at any other (and one in the backward pass). The padded entries are set without autograd:
    their gradient is their softmax, exp(-1e30) = 0, either way, and a masked_fill would copy
    the logits once more in each pass. The learner used to take three fp32 copies here (a float,
    a tempered and a transposed one: ~14 GiB a microbatch of 8192 tokens at a 151,936-token
    vocabulary); megatron's cross entropy then works in place on these and keeps them as the
    softmax for the backward pass."""
    logits = logits_bsv.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab_local = logits.shape[-1]
    real = vocab_size - tp_rank * vocab_local
    if real < vocab_local:
        with torch.no_grad():
            logits[..., max(real, 0):] = PAD_LOGIT
    return logits


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the tempered next-token distribution whose vocabulary shard
    ``logits`` holds, reduced over the TP group: two all-reduces of a few floats a position (the
    max, then the normaliser and E[logit] together), the same on every TP rank. Costs ~4 passes
    over the logits in chunks of ``ENTROPY_CHUNK`` (at the 70B config, 4096 x 16,032 logits a
    microbatch: ~0.4 ms on an H100 against ~150 ms for the microbatch's forward and backward;
    256 MB at most beside them)."""
    group = mpu.get_tensor_model_parallel_group()
    flat = logits.reshape(-1, logits.shape[-1])
    m = flat.amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = torch.empty(2, flat.shape[0], dtype=flat.dtype, device=flat.device)
    rows = max(1, ENTROPY_CHUNK // flat.shape[-1])
    for lo in range(0, flat.shape[0], rows):
        e = torch.exp(flat[lo:lo + rows] - m[lo:lo + rows, None])
        sums[0, lo:lo + rows] = e.sum(-1)
        sums[1, lo:lo + rows] = torch.linalg.vecdot(e, flat[lo:lo + rows])
    dist.all_reduce(sums, group=group)
    return (torch.log(sums[0]) + m - sums[1] / sums[0]).view(logits.shape[:-1])

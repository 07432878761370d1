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


def vocab_parallel_entropy(logits: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """Per-position entropy of the tempered next-token distribution whose vocabulary shard
    ``logits`` holds, reduced over the TP group: two all-reduces of a few floats a position (the
    max, then the normaliser and E[logit] together), the same on every TP rank. Costs ~4 passes
    over the logits in chunks of ``ENTROPY_CHUNK`` (at the 70B config, 4096 x 16,032 logits a
    microbatch: ~0.4 ms on an H100 against ~150 ms for the microbatch's forward and backward;
    256 MB at most beside them).

    With ``grad`` (an entropy bonus in the loss) its gradient flows to the logits: dH/dl_j =
    -p_j (l_j - E[l]) on each rank's shard from the forward's reduced normaliser and E[l], so the
    backward issues no collective (each TP rank's backward is local, fillers' included: what the
    forward's two all-reduces keep in step). It keeps an fp32 copy of the logits for the
    backward: megatron's cross entropy, which runs after it, overwrites the logits in place."""
    if grad and logits.requires_grad:
        return _EntropyWithGrad.apply(logits)
    with torch.no_grad():
        return _entropy_parts(logits)[0]


def _entropy_parts(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    """(entropy, max, normaliser, E[logit]) per position, the last three ``[positions]``, each
    reduced over the TP group (no gradient)."""
    group = mpu.get_tensor_model_parallel_group()
    flat = logits.detach().reshape(-1, logits.shape[-1])
    m = flat.amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = torch.empty(2, flat.shape[0], dtype=flat.dtype, device=flat.device)
    rows = max(1, ENTROPY_CHUNK // flat.shape[-1])
    for lo in range(0, flat.shape[0], rows):
        e = torch.exp(flat[lo:lo + rows] - m[lo:lo + rows, None])
        sums[0, lo:lo + rows] = e.sum(-1)
        sums[1, lo:lo + rows] = torch.linalg.vecdot(e, flat[lo:lo + rows])
    dist.all_reduce(sums, group=group)
    mean = sums[1] / sums[0]
    entropy = (torch.log(sums[0]) + m - mean).view(logits.shape[:-1])
    return entropy, m, sums[0], mean


class _EntropyWithGrad(torch.autograd.Function):
    """The vocabulary-parallel entropy with its gradient (see ``vocab_parallel_entropy``)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        entropy, m, z, mean = _entropy_parts(logits)
        ctx.save_for_backward(logits.detach().clone(), m, z, mean)
        return entropy

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        logits, m, z, mean = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(-1)
        rows = max(1, ENTROPY_CHUNK // flat.shape[-1])
        # the gradient overwrites the saved copy, chunk by chunk (each chunk needs only its own
        # logits): no third fp32 copy of the logits at the backward's peak
        for lo in range(0, flat.shape[0], rows):
            hi = lo + rows
            chunk = flat[lo:hi]
            p = torch.exp(chunk - m[lo:hi, None]) / z[lo:hi, None]
            chunk.sub_(mean[lo:hi, None]).mul_(p).mul_(-g[lo:hi, None])
        return logits

"""Runs under torchrun: layouts of the learner on a tiny model, one after the other in one launch
(each launch costs ~10 s of start-up on 2 cores); rank 0 saves what each measured.

python -m torch.distributed.run --nproc_per_node N tests/dist/worker.py BATCH JOBS

JOBS is a JSON file: a list of {"out": DIR, "overrides": [KEY=VALUE, ...], "offload": bool}, each
a layout of N ranks, its overrides naming the tiny checkpoint (``model.path``; jobs of several
models may share a launch). Between jobs megatron's parallel state is torn down and made again for the
next layout (the default process group stays). BATCH is a safetensors file with tokens,
response_mask, behav_logp, advantages, ref_logp, is_weight (importance weights, ``algo.rollout_is``)
and nan_behav (a copy of behav_logp with a NaN, whose step must be skipped). Each OUT gets tensors.safetensors (log-probs and entropy before the updates,
log-probs after, logits at TP1), weights.safetensors and grads.safetensors (HF-named, after the
first update) and result.json (the step results). The last update takes only this data-parallel
rank's rows (``train_step(dp_local=True)``, as the trainer gives them). With "offload" the learner
is offloaded to the host and back before it. result.json also records the input shape of every
dense GEMM (the layers that are Transformer Engine's FP8 GEMMs on a GPU), the timeout of every
process group, as this rank saw them, and the most reads of a tensor's values to the host that
our code made in one call of logprobs and train_step on any rank (``HostReads``).
"""

import gc
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import mugrpo_megatron

from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.learner.compat_megatron import inner_optimizers, megatron_on_cpu
from mugrpo_megatron.learner.export import iter_hf_tensors
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.types import TokenBatch, TrainBatch

PACKAGE = str(Path(mugrpo_megatron.__file__).parent)  # the package these ranks run
TORCH = str(Path(torch.__file__).parent)
READS = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__"}


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values to the host (on a GPU each is a device
    synchronisation) made directly by our package's code (megatron's own are not counted); on
    CPU they cost nothing, but the count is the same as on a GPU."""

    def __init__(self):
        super().__init__()
        self.ours = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith(TORCH)
                                         or frame.f_code.co_name == "__torch_function__"):
                frame = frame.f_back  # past torch and other modes (compat_megatron's CPU one)
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                self.ours += 1
        return func(*args, **(kwargs or {}))


def counted(reads: dict, name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with the host reads of our code it made added to ``reads``."""
    with HostReads() as mode:
        out = fn(*args, **kwargs)
    reads[name] = mode.ours
    return out


def hf_state(learner, **kw):
    return {n: t.cpu().clone() for n, t in iter_hf_tensors(learner.chunks(), learner.spec, **kw)}


def optimizer_checksum(learner) -> float:
    total = torch.zeros((), dtype=torch.float64)
    # every torch optimizer inside megatron's (chained: dense and MoE-expert parameters apart)
    for inner in inner_optimizers(learner.optimizer):
        for state in inner.optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    total += v.double().abs().sum()
    torch.distributed.all_reduce(total)
    return float(total)


def dp_share(learner, batch: TrainBatch) -> TrainBatch:
    """This data-parallel rank's rows of ``batch``, right-padded to their longest + 3 * dp_rank."""
    rows = learner.dp_rows(batch.size)
    longest = int(torch.nonzero(batch.response_mask[rows].any(0)).max()) + 1
    end = longest + 3 * learner.layout.dp_rank

    def cut(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((rows.stop - rows.start, end), dtype=t.dtype)
        out[:, :longest] = t[rows, :longest]
        return out

    return TrainBatch(cut(batch.tokens), cut(batch.response_mask), cut(batch.behav_logp),
                      batch.advantages[rows], cut(batch.ref_logp), cut(batch.is_weight))


GEMMS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def record_gemm_inputs(learner) -> set[tuple[int, ...]]:
    """Input shapes of every forward of the dense projections (TE's FP8 GEMMs on a GPU; MoE
    experts are padded by megatron-core itself), collected as they run."""
    shapes: set[tuple[int, ...]] = set()
    for chunk in learner.chunks():
        for name, module in chunk.named_modules():
            if name.rsplit(".", 1)[-1] in GEMMS and ".experts." not in name:
                module.register_forward_pre_hook(lambda m, args: shapes.add(tuple(args[0].shape)))
    return shapes


def group_timeouts() -> list[float]:
    """Minutes of every process group this rank belongs to (gloo), as torch keeps them."""
    from torch.distributed.distributed_c10d import _world

    return sorted({pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60
                   for pg in _world.pg_map})


def main() -> None:
    from megatron.core import parallel_state as mpu  # after the learner's own import of it

    batch_path, jobs = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    for job in jobs:
        run_layout(batch_path, Path(job["out"]), job["overrides"], job["offload"])
        gc.collect()
        mpu.destroy_model_parallel()  # the next layout makes its own groups
    torch.distributed.destroy_process_group()


def run_layout(batch_path: str, out: Path, overrides: list[str], offload_too: bool) -> None:
    cfg = load_config(None, ["model.dtype=float32", *overrides])
    learner = Learner.from_config(cfg)
    gemm_inputs = record_gemm_inputs(learner)
    b = load_file(batch_path)
    batch = TrainBatch(b["tokens"], b["response_mask"].bool(), b["behav_logp"], b["advantages"],
                       b["ref_logp"], b["is_weight"])
    tensors = {}
    if torch.distributed.get_world_size() == 1:
        pos = torch.arange(batch.tokens.shape[1]).expand(batch.size, -1)
        with torch.no_grad(), megatron_on_cpu():
            logits = learner.chunks()[0](batch.tokens, pos, None)
            tensors["logits"] = logits[..., :learner.spec.vocab_size].contiguous()
    reads: dict[str, int] = {}
    tensors["logp0"], tensors["entropy"] = counted(
        reads, "logprobs", learner.logprobs, TokenBatch(batch.tokens, batch.response_mask),
        with_entropy=True)
    steps = [counted(reads, "train_step", learner.train_step, batch)]
    # a frozen parameter (model.freeze_router) has no gradient buffer: zeros in its place
    grads = hf_state(learner, tensor_of=lambda p: p.main_grad if p.requires_grad else 0 * p)
    before = hf_state(learner)
    checksum = optimizer_checksum(learner)
    steps.append(learner.train_step(TrainBatch(batch.tokens, batch.response_mask, b["nan_behav"],
                                               batch.advantages, batch.ref_logp, batch.is_weight)))
    after = hf_state(learner)
    untouched = all(torch.equal(before[k], after[k]) for k in before) and \
        checksum == optimizer_checksum(learner)
    offload = {}
    if offload_too:  # as the trainer does before a sync: all of it to the host
        from mugrpo_megatron.learner.offload import HostPool

        learner._host.pool = HostPool(chunk=1 << 12)  # small chunks: every storage spans several
        before_bytes = learner.resident_bytes()
        on_device_stream = hf_state(learner)
        out_stats = learner.offload()
        # a sync streams from the host copy, one parameter at a time: the same tensors, bit for
        # bit, with nothing of the learner on the device
        from_host = hf_state(learner, tensor_of=learner.host_tensor)
        offload = {"resident_before": before_bytes, "resident_offloaded": learner.resident_bytes(),
                   "on_device_at_sync": learner.on_device,
                   "host_stream_equal": sorted(from_host) == sorted(on_device_stream) and all(
                       torch.equal(from_host[k], on_device_stream[k]) for k in from_host),
                   "freed": out_stats.bytes_freed, "copied": out_stats.bytes_copied,
                   "host_bytes": learner.host_bytes, "requested": learner._host.pool.requested}
        in_stats = learner.onload()
        offload.update(resident_after=learner.resident_bytes(), restored=in_stats.bytes_freed)
        # a reference swapped in while the learner is on the device (a resumed phase's pass):
        # the learner's own weights wait in host memory for the pass, and that memory is let go
        learner.keep_reference()
        with learner.reference_weights():
            learner.logprobs(TokenBatch(batch.tokens, batch.response_mask))
            offload["reference_held_during"] = learner.reference.held_bytes
        offload.update(reference_held_after=learner.reference.held_bytes,
                       reference_bytes=learner.reference.nbytes)
        learner.reference = None
    # the last update as the trainer gives it: only this data-parallel rank's rows, padded to
    # their own longest plus a few columns a rank (so DP ranks differ in length, as shards do)
    steps.append(counted(reads, "train_step_dp_local", learner.train_step,
                         dp_share(learner, batch), dp_local=True))
    every_rank: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, reads)
    tensors["logp1"], _ = learner.logprobs(TokenBatch(batch.tokens, batch.response_mask))
    # an odd length (sequence parallel pads it to a multiple of TP and crops the answer)
    tensors["logp_odd"], _ = learner.logprobs(TokenBatch(batch.tokens[:, :-1],
                                                         batch.response_mask[:, :-1]))
    weights = hf_state(learner)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "tensors.safetensors"))
        save_file(weights, str(out / "weights.safetensors"))
        save_file(grads, str(out / "grads.safetensors"))
        (out / "result.json").write_text(json.dumps({
            "skipped_step_left_state_untouched": untouched,
            "num_updates": learner.num_updates, "offload": offload,
            "gemm_inputs": sorted(gemm_inputs), "token_multiple": learner.token_multiple,
            "group_timeouts": group_timeouts(),
            "host_reads": {k: max(r[k] for r in every_rank) for k in reads},
            "steps": [{"loss": s.loss, "grad_norm": s.grad_norm, "skipped": s.skipped,
                       "reason": s.reason, "lr": s.lr, "metrics": s.metrics} for s in steps]}))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()

"""Runs under torchrun: the dry run's memory items measured on CPU, with glibc's count of the
heap bytes in use (``mallinfo2``: arena and mmapped chunks) read after every torch operation,
so that a peak between two reads of Python is not missed. Rank 0 writes what it measured.

python -m torch.distributed.run --nproc_per_node N tests/dist/memory_worker.py MODE HF_DIR OUT

- ``learner`` (2 ranks, TP2, a large vocabulary so that logits dominate): the peak of an update
  above the memory in use before it (the second update: the first allocates Adam's state), and
  the peak while a weight sync's stream is drained, beside the dry run's ``logits_bytes`` and
  ``stream_bytes`` for the same shapes.
- ``reload`` (1 rank, a mixture of experts, vLLM in the process): the most bytes of streamed
  tensors alive at once while the engine loads them (what its layer-wise reload holds), beside
  ``reload_held``'s module and vocabulary and the largest tensor.
"""

import ctypes
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.dryrun.memory import logits_bytes, reload_held, stream_bytes
from mugrpo_megatron.learner.export import iter_hf_tensors
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.types import TrainBatch


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def heap_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakHeap(TorchDispatchMode):
    """The most heap bytes in use, above what was in use on entry, read after every operation
    (backward ones too: the autograd engine runs CPU work on the calling thread)."""

    def __enter__(self):
        self.base = heap_in_use()
        self.peak = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            # Gloo runs a collective on its worker thread, and an all-gather there stages the
            # whole output in a flat buffer of its own (torch 2.x ProcessGroupGloo.cpp,
            # AsyncAllgatherWork: newLikeFlat, freed when the work is done); NCCL, what the dry
            # run budgets, gathers into the output. Read the heap once the work is done, so
            # that the reading neither races the worker thread nor counts gloo's staging.
            for work in _works(out):
                work.wait()
        self.peak = max(self.peak, heap_in_use() - self.base)
        return out


def _works(out) -> list:
    """The work handles among a c10d op's outputs (boxed: the dispatcher's view of them)."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [torch.distributed.Work.unbox(x) for x in items if isinstance(x, torch.ScriptObject)]


def learner_mode(hf_dir: str, extra: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, [f"model.path={hf_dir}", "model.dtype=float32", "parallel.tensor=2",
                             "parallel.micro_batch_size=1", "algo.samples_per_update=2",
                             "algo.total_updates=4", "algo.updates_per_phase=4",
                             "data.max_prompt_tokens=256", "rollout.max_new_tokens=256",
                             "parallel.pack_tokens=0", "optim.lr=1e-4", *extra])
    learner = Learner.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    seq = 512
    tokens = torch.randint(3, learner.spec.vocab_size, (2, seq), generator=g)
    resp = torch.zeros(2, seq, dtype=torch.bool)
    resp[:, 16:] = True
    batch = TrainBatch(tokens, resp, torch.where(resp, -torch.rand(2, seq, generator=g) * 5,
                                                 torch.zeros(2, seq)), torch.tensor([1.0, -1.0]))
    learner.train_step(batch)  # Adam's state, the grad buffers: allocated before the measure
    with PeakHeap() as update:
        step = learner.train_step(batch)
    assert not step.skipped, step.reason
    vocab_rows = learner.spec.padded_vocab_size(2) // 2
    with PeakHeap() as export:
        names = sum(1 for _ in iter_hf_tensors(learner.chunks(), learner.spec, bucket_bytes=1 << 16))
    return {"update_peak": update.peak, "stream_peak": export.peak, "tensors": names,
            # one microbatch of one row: the dry run's logits for it
            "logits": logits_bytes(seq, vocab_rows, "float32", cfg.rollout.temperature,
                                   entropy_grad=cfg.algo.entropy_coef > 0),
            "logits_numel": seq * vocab_rows,
            "stream": stream_bytes(learner.spec, 2, 1, 1 << 16, "float32")}


def reload_mode(hf_dir: str) -> dict:
    from mugrpo_megatron.engines.fleet import EngineFleet

    cfg = load_config(None, [f"model.path={hf_dir}", "model.dtype=float32",
                             "algo.samples_per_update=2", "algo.total_updates=4",
                             "algo.updates_per_phase=4"])
    learner = Learner.from_config(cfg)
    engines = EngineFleet.start(cfg.rollout, hf_dir, dtype="float32", max_model_len=128,
                                load_weights=False, timeout_minutes=cfg.parallel.timeout_minutes)
    alive = {"now": 0, "most": 0, "largest": 0}

    def gone(nbytes: int) -> None:
        alive["now"] -= nbytes

    def tracked(stream):
        for name, t in stream:
            nbytes = t.numel() * t.element_size()
            alive["now"] += nbytes
            alive["most"] = max(alive["most"], alive["now"])
            alive["largest"] = max(alive["largest"], nbytes)
            weakref.finalize(t, gone, nbytes)
            yield name, t
            del t

    # buckets of one small tensor or a few: what the export holds of a bucket stays small
    bucket = 1 << 16
    engines.update_weights(tracked(iter_hf_tensors(learner.chunks(), learner.spec,
                                                   bucket_bytes=bucket)))
    engines.shutdown()
    module, vocab = reload_held(learner.spec, "float32")
    return {"most_alive": alive["most"], "largest": alive["largest"], "bucket": bucket,
            "module": module, "vocab": vocab}


def main() -> None:
    mode, hf_dir, out = sys.argv[1:4]
    torch.set_num_threads(1)
    from mugrpo_megatron.distributed import init_default_group

    init_default_group(30)
    if mode == "learner":
        result = learner_mode(hf_dir)
    elif mode == "learner_entropy":  # an entropy bonus (its gradient) at a temperature below 1
        result = learner_mode(hf_dir, ("algo.entropy_coef=0.01", "rollout.temperature=0.7"))
    else:
        result = reload_mode(hf_dir)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

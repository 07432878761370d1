"""``benchmarks/device_check.py``'s sections on a phase's life: device memory at each transition,
a checkpoint save and load, FP8 on token counts TE's GEMMs refuse unpadded (issue 20's checks),
and TE's amax reductions counted per microbatch (issue 29's rule), kept apart so that each file
stays readable."""

from __future__ import annotations

import gc
import re
import tempfile
import time
from pathlib import Path

import torch
from common import random_batch


def fp8_odd_lengths(state: dict, args) -> dict:
    """The FP8 learner on a batch of 1021-token rows (not a multiple of 8 or 16): its log-probs
    and an update, which Transformer Engine refuses unless the learner pads the tokens."""
    learner = state["learner"]
    prompt = args.seq // 4 - 3
    batch = random_batch(args.samples, prompt, args.seq - prompt - 3, learner.spec.vocab_size)
    logp, _ = learner.logprobs(batch)
    step = learner.train_step(batch)
    return {"seq": int(batch.tokens.shape[1]), "token_multiple": learner.token_multiple,
            "logp_finite": bool(torch.isfinite(logp).all()), "loss": step.loss,
            "skipped": step.skipped,
            "checked": ["TE's FP8 GEMMs on token counts that are multiples of neither 8 nor 16, "
                        "padded by the learner"], "not_checked": []}


def fp8_amax_per_microbatch(state: dict, args) -> dict:
    """The rule that makes data-parallel ranks run equal microbatch counts, read off Transformer
    Engine itself: with delayed scaling it reduces amax (an all-reduce over megatron's
    amax-reduction group, which spans data parallelism, once there are several ranks) per
    microbatch, forward and backward. Updates of 1, 2 and 4 microbatches each count
    ``FP8GlobalStateManager.reduce_and_update_fp8_tensors`` calls by direction; the rule holds
    when the calls per microbatch are the same at every count (so a rank with fewer microbatches
    would issue fewer collectives: tests/test_collectives.py emulates exactly this on gloo)."""
    from transformer_engine.pytorch import quantization

    manager = quantization.FP8GlobalStateManager
    learner = state["learner"]
    calls = {"forward": 0, "backward": 0}
    original = manager.reduce_and_update_fp8_tensors.__func__
    ran: list[int] = []
    run = learner._run

    def counting(cls, forward: bool = True) -> None:
        calls["forward" if forward else "backward"] += 1
        return original(cls, forward)

    def counted_run(microbatches, *a, **k):
        ran.append(len(microbatches))
        return run(microbatches, *a, **k)

    rows = []
    manager.reduce_and_update_fp8_tensors = classmethod(counting)
    learner._run = counted_run
    try:
        for k in (1, 2, 4):
            batch = random_batch(args.micro * k, args.seq // 4, args.seq - args.seq // 4,
                                 learner.spec.vocab_size, seed=k)
            calls.update(forward=0, backward=0)
            ran.clear()
            step = learner.train_step(batch)
            rows.append({"microbatches": sum(ran), "forward_reductions": calls["forward"],
                         "backward_reductions": calls["backward"], "skipped": step.skipped})
    finally:
        manager.reduce_and_update_fp8_tensors = classmethod(original)
        del learner._run
    per = {(r["forward_reductions"] / r["microbatches"], r["backward_reductions"] / r["microbatches"])
           for r in rows}
    if len(per) != 1 or min(next(iter(per))) < 1:
        raise AssertionError(f"amax reductions are not a fixed number per microbatch: {rows}")
    fwd, bwd = next(iter(per))
    return {"updates": rows, "forward_per_microbatch": fwd, "backward_per_microbatch": bwd,
            "checked": ["TE's amax reductions a fixed number per microbatch (the rule behind "
                        "equal microbatch counts across DP ranks)"],
            "not_checked": ["the reduction's group across ranks (world size 1)"]}


def _device_memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    out = {"used_gib": (total - free) / 2**30,
           "allocator_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    return out


def transitions_section(path: Path, state: dict, args) -> dict:
    """Two phases with an evaluation, in the trainer's order: the learner offloaded while the
    engine starts, generates and evaluates (the engine asleep otherwise), back for the sync and
    the updates, and a save. Device memory at each, and the dry run's estimate beside it."""
    from mugrpo_megatron.dryrun.memory import GIB, H100_GIB, estimate

    learner, cfg, batch = state["learner"], state["cfg"], state["batch"]
    engine = state.get("engine_obj")
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB \
        if torch.cuda.is_available() else H100_GIB
    items = estimate(cfg, learner.spec, 1, gpu_gib=gpu_gib, ranks_per_node=1)["transition_items"]
    # only the items that run here: without an engine, none of the engine's; at world size 1 no
    # NCCL communicator has its buffers
    ran = {name: {k: v for k, v in parts.items() if (engine is not None
                                                     or not k.startswith("engine"))
                  and k != "NCCL"} for name, parts in items.items()}
    marks = []

    def mark(name: str, phase: int) -> None:
        marks.append({"transition": name, "phase": phase, **_device_memory(),
                      "estimate_gib": sum(ran[name].values()) / GIB,
                      "items_estimated": sorted(ran[name])})

    with tempfile.TemporaryDirectory() as tmp:
        from mugrpo_megatron.learner.checkpoint import save_learner

        learner.offload()
        mark("start", 0)
        learner.onload()
        for phase in range(2):
            # the trainer's sync: the learner offloaded whole, the stream read from its host copy
            from mugrpo_megatron.learner.export import iter_hf_tensors

            learner.offload()
            stream = iter_hf_tensors(learner.chunks(), learner.spec, bucket_bytes=256 << 20,
                                     tensor_of=learner.host_tensor)
            if engine is not None:
                engine.wake(weights_only=True)
                engine.update_weights(stream)
            else:  # no engine here: the stream is still read, from pinned host memory
                for _ in stream:
                    pass
            mark("sync", phase)
            for name in ("generate", "evaluate"):
                if engine is not None:
                    engine.wake()
                    from mugrpo_megatron.engines import SamplingSpec

                    engine.generate([list(range(5, 5 + args.seq // 4))] * 4,
                                    SamplingSpec(n=2, max_new_tokens=args.new_tokens))
                mark(name, phase)
                if engine is not None:
                    engine.sleep()
            learner.onload()
            for _ in range(2):
                learner.train_step(batch)
            mark("optimize", phase)
            save_learner(learner, Path(tmp) / "ckpt", {"update": 0, "phase": phase})  # replaced
            mark("save", phase)
    left_out = sorted({k for parts in items.values() for k in parts} -
                      {k for parts in ran.values() for k in parts})
    return {"marks": marks, "with_engine": engine is not None,
            "peak_used_gib": max((m.get("used_gib", 0.0) for m in marks), default=0.0),
            "checked": ["device memory at each transition of two phases in the trainer's order "
                        "against the dry run's estimate of the items that ran"],
            "not_checked": ([] if engine is not None else
                            ["the engine's items (no vLLM here): left out of the estimate: "
                             + ", ".join(k for k in left_out if k.startswith("engine"))])
            + ["NCCL's buffers (world size 1: no communicator)"]}


def checkpoint_section(state: dict) -> dict:
    """A save and a load of the learner: time, the host memory the save adds, and the weights."""
    from mugrpo_megatron.learner.checkpoint import load_learner, save_learner
    from mugrpo_megatron.learner.export import iter_hf_tensors

    learner = state["learner"]

    def rss(key: str) -> int:
        return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())
                   .group(1)) * 1024

    weights = {n: t.cpu().clone() for n, t in iter_hf_tensors(learner.chunks(), learner.spec)}
    params = sum(p.numel() for c in learner.chunks() for p in c.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        gc.collect()
        before = rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        save_learner(learner, Path(tmp) / "ckpt", {"update": 1, "phase": 0})
        save_s = time.perf_counter() - t0
        extra = rss("VmHWM") - before
        t0 = time.perf_counter()
        load_learner(learner, Path(tmp) / "ckpt")
        load_s = time.perf_counter() - t0
    after = {n: t.cpu() for n, t in iter_hf_tensors(learner.chunks(), learner.spec)}
    return {"save_s": save_s, "load_s": load_s, "host_extra_gib": extra / 2**30,
            "own_optimizer_shard_gib": 12 * params / 2**30,
            "weights_bit_exact": all(torch.equal(weights[n], after[n]) for n in weights),
            "checked": ["a save and a load of the learner on the GPU: seconds, the host memory "
                        "the save adds, the weights bit for bit"],
            "not_checked": ["the distributed optimizer's sharded state and a layout change "
                            "(world size 1; the CPU tests cover both over gloo)"]}

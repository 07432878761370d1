"""Runs under torchrun: the learner in some layout resharding into the rollout engines (one per
rank's replica with placement spmd, or one on rank 0).

python -m torch.distributed.run --nproc_per_node N tests/dist/engine_worker.py JOBS.json
(or one launcher a node: tests/helpers.py ``torchrun_nodes``)

JOBS.json: a list of jobs, each {"hf": HF_DIR, "out": OUT, "overrides": [KEY=VALUE, ...],
"bucket_bytes": int or null, "dummy_engine": bool}, run one after another in this launch (the
imports and the launch are most of a job's cost on CPU): each builds its learner and engines,
measures, and shuts both down again. For each, it measures the train/inference log-prob gap on
the engine's own samples before and after a training step, after deliberately wrong weight
layouts, and compares greedy outputs with transformers on the exported HF checkpoint. Rank 0
writes OUT/result.json.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.engines import SamplingSpec
from mugrpo_megatron.engines.fleet import EngineFailed, EngineFleet
from mugrpo_megatron.handoff import sync_engine_tp
from mugrpo_megatron.learner.export import iter_hf_tensors, save_hf_checkpoint
from mugrpo_megatron.learner.learner import Learner
from mugrpo_megatron.phase.batches import logprob_gap
from mugrpo_megatron.types import Shard

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from helpers import Sample, to_batch  # noqa: E402

PROMPTS = [[5, 17, 33, 9], [101, 7, 250], [42, 42, 8, 19, 3, 77], [300, 12]]


def corrupt(stream, how, spec):
    """Deliberately wrong layouts that a resharding bug could produce (a rank's slice sent as
    the full-shape tensor it stands for)."""
    for name, t in stream:
        t = t.whole() if isinstance(t, Shard) else t
        if how == "swap_qkv_groups" and name.endswith(("self_attn.q_proj.weight",
                                                       "self_attn.q_b_proj.weight")):
            half = t.shape[0] // 2  # query heads of group 0 <-> group 1 (MLA: of TP rank 0 <-> 1)
            t = torch.cat([t[half:], t[:half]])
        elif how == "swap_gate_up" and "gate_proj" in name:
            name = name.replace("gate_proj", "up_proj")
        elif how == "swap_gate_up" and "up_proj" in name:
            name = name.replace("up_proj", "gate_proj")
        elif how == "swap_gate_up" and name.endswith((".w1.weight", ".w3.weight")):  # Mixtral's
            name = name[:-10] + (".w3.weight" if name.endswith(".w1.weight") else ".w1.weight")
        elif how == "pad_vocab" and name == "model.embed_tokens.weight":
            t = torch.cat([t, torch.zeros(128 - t.shape[0] % 128, t.shape[1], dtype=t.dtype)])
        elif how == "permute_experts" and ".experts." in name:
            # the first and last experts trade places: with EP2 they live on different
            # expert-parallel ranks, as an export that misplaced a rank's expert offset would
            # send them (FusedMoE's loader takes each expert by its HF index)
            last = spec.num_experts - 1
            name = name.replace(".experts.0.", ".experts.@.").replace(
                f".experts.{last}.", ".experts.0.").replace(".experts.@.", f".experts.{last}.")
        yield name, t


def main() -> None:
    from megatron.core import parallel_state as mpu  # after the learner's own import of it

    launcher = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's, before any engine started
    for job in json.loads(Path(sys.argv[1]).read_text()):
        run_contract(job["hf"], Path(job["out"]), job["overrides"], job.get("bucket_bytes"),
                     job.get("dummy_engine", False), launcher)
        gc.collect()
        mpu.destroy_model_parallel()  # the next job makes its own groups
        dist.barrier()
    dist.destroy_process_group()


def run_contract(hf_dir: str, out: Path, overrides: list[str], bucket_bytes: int | None,
                 dummy_engine: bool, launcher_local_world: str | None) -> None:
    cfg = load_config(None, [f"model.path={hf_dir}", "model.dtype=float32",
                             "algo.samples_per_update=8", "algo.total_updates=8",
                             "algo.updates_per_phase=4", "optim.lr=1e-2", *overrides])
    learner = Learner.from_config(cfg)
    rank0 = dist.get_rank() == 0
    # dummy_engine: the engines start as the trainer starts them, with placeholder weights, and
    # the first sync below supplies every weight
    engines = EngineFleet.start(cfg.rollout, hf_dir, dtype="float32", max_model_len=128,
                                load_weights=not dummy_engine,
                                timeout_minutes=cfg.parallel.timeout_minutes)
    # tests pass a bucket smaller than the largest tensor to check that such a tensor travels alone
    bucket = bucket_bytes or cfg.rollout.weight_bucket_mb << 20
    llm = getattr(engines.engine, "llm", None)  # vLLM: what it was told to load
    result: dict = {"engine": cfg.rollout.engine, "gaps": {}, "sync": [],
                    "load_format": str(llm.llm_engine.vllm_config.load_config.load_format)
                    if llm is not None else None,
                    "replicas": engines.num_replicas,
                    "describe": engines.describe(),
                    # what placement reads, as torchrun set it and after the engines started
                    "local_world_size": [launcher_local_world, os.environ.get("LOCAL_WORLD_SIZE")]}

    # the trainer's choice: each rank streams only its shards where its engine rank keeps them
    engine_tp = sync_engine_tp(cfg.rollout, learner)
    result["sync_engine_tp"] = engine_tp
    group = engines._replica_group  # a replica's own gloo group (spmd at TP > 1)
    result["replica_group_timeout_s"] = None if group is None else \
        group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    def sync(how=None):
        stream = iter_hf_tensors(learner.chunks(), learner.spec, bucket_bytes=bucket,
                                 engine_tp=engine_tp)
        if how:
            stream = corrupt(stream, how, learner.spec)
        try:
            stats = engines.update_weights(stream)
        except EngineFailed as e:  # on every rank, with the refusing engine's message
            return str(e)
        if stats is not None:
            result["sync"].append({"tensors": stats.num_tensors, "bytes": stats.num_bytes})
        if "sync_bytes_by_rank" not in result:  # what each rank's engine took, the first time
            counted = [None] * dist.get_world_size()
            dist.all_gather_object(counted, None if stats is None else stats.num_bytes)
            result["sync_bytes_by_rank"] = counted
        return None

    def sample_and_score(label, greedy=False):
        spec = SamplingSpec(n=1 if greedy else 2, max_new_tokens=12,
                            temperature=0.0 if greedy else cfg.rollout.temperature, seed=0)
        samples = []
        generated = engines.generate(PROMPTS, spec)
        if rank0:
            for i, gens in enumerate(generated):
                samples += [Sample(0, i, i, tuple(PROMPTS[i]), g.token_ids, g.logprobs,
                                   g.finish_reason, advantage=(1.0 if j == 0 else -1.0))
                            for j, g in enumerate(gens)]
        if label == "initial":
            result["initial_samples"] = [list(x.response_ids) for x in samples]
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        batch = to_batch(box[0])
        logp, _ = learner.logprobs(batch)
        gap = logprob_gap(logp, batch)
        result["gaps"][label] = {"mean": gap.mean, "max": gap.max, "tokens": gap.num_tokens}
        return batch, box[0]

    sync()
    if engines.engine is not None:
        # streaming (refilled as groups finish, positions out of order) samples what one call does
        spec = SamplingSpec(n=2, max_new_tokens=12, temperature=cfg.rollout.temperature, seed=7)
        order = [2, 0, 3, 1]
        whole = engines.engine.generate([PROMPTS[i] for i in order], spec)
        streamed = dict(engines.engine.generate_stream(
            [PROMPTS[i] for i in order[::-1]], spec, positions=[3, 2, 1, 0], max_in_flight=2))
        pairs = [(a, b) for k in range(4) for a, b in zip(whole[3 - k], streamed[k])]
        result["stream"] = {
            "same_tokens": all(a.token_ids == b.token_ids for a, b in pairs),
            "max_logprob_diff": max(abs(x - y) for a, b in pairs
                                    for x, y in zip(a.logprobs, b.logprobs))}
    if engines.engine is not None and cfg.rollout.max_num_seqs:
        result["bounded_stream"] = bounded_stream(engines.engine, cfg)
    batch, _ = sample_and_score("initial")
    step = learner.train_step(batch)
    result["step"] = {"loss": step.loss, "skipped": step.skipped}
    sample_and_score("stale")  # the engine still has the old weights: the check must see it
    sync()
    sample_and_score("after_step")
    for how in ("swap_qkv_groups", "swap_gate_up",
                *(("permute_experts",) if learner.spec.is_moe else ())):
        err = sync(how)
        if err is None:
            sample_and_score(how)
        else:
            result["gaps"][how] = {"refused": err}
        sync()
    sample_and_score("restored")
    # greedy outputs against transformers on the exported checkpoint
    _, greedy = sample_and_score("greedy", greedy=True)
    save_hf_checkpoint(iter_hf_tensors(learner.chunks(), learner.spec, bucket_bytes=bucket),
                       out / "hf", hf_dir, write=rank0, dtype="float32")
    # last, since vLLM leaves its model half-loaded when it refuses a tensor
    result["gaps"]["pad_vocab"] = {"refused": sync("pad_vocab")}
    if rank0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32)
        same = []
        for s in greedy:
            ids = torch.tensor([list(s.prompt_ids)])
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            same.append(gen[0, ids.shape[1]:].tolist()[:len(s.response_ids)] == list(s.response_ids))
        result["greedy_equal"] = same
        (out / "result.json").write_text(json.dumps(result, indent=1))
    engines.shutdown()
    dist.barrier()


def bounded_stream(engine, cfg) -> dict:
    """The queue a replica keeps by default (``EngineFleet.queued``) with an engine
    capped at ``rollout.max_num_seqs`` running sequences: the engine reports that cap, and while
    12 prompts stream it never holds more than the window's requests (vLLM counts each of a
    group's n samples as one), yet samples what one call over all 12 samples."""
    from dataclasses import replace

    from mugrpo_megatron.engines.fleet import inflight_prompts

    spec = SamplingSpec(n=2, max_new_tokens=12, temperature=cfg.rollout.temperature, seed=11)
    prompts = [PROMPTS[i % 4] + [7 + i] for i in range(12)]
    window = inflight_prompts(replace(cfg.rollout, group_size=spec.n), engine.streams,
                              engine.max_running_sequences)
    core = engine.llm.llm_engine
    step, peak = core.step, [0]

    def counted_step():  # instrumentation of this test: the requests the engine holds
        peak[0] = max(peak[0], core.get_num_unfinished_requests())
        return step()

    core.step = counted_step
    try:
        streamed = dict(engine.generate_stream(prompts, spec, positions=list(range(12)),
                                               max_in_flight=window))
    finally:
        core.step = step
    whole = engine.generate(prompts, spec)
    return {"running": engine.max_running_sequences, "window": window, "peak_requests": peak[0],
            "same_tokens": all(a.token_ids == b.token_ids for k in range(12)
                               for a, b in zip(whole[k], streamed[k]))}


if __name__ == "__main__":
    main()

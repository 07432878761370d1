"""Runs under torchrun: Transformer Engine's FP8 extra state through megatron-core's sharding and
our checkpoint save and load, in one layout (tests/test_fp8.py says why).

python -m torch.distributed.run --nproc_per_node N tests/dist/fp8_state_worker.py \
    LAYOUT HF_DIR OUT SAVE|- LOAD...

LAYOUT tp1, tp2, pp2 or dp2 (N = 1 or 2). Two layers, each a column-parallel linear whose extra
state is in TE 2.x's format, its scales this rank's own (1 + layer + 0.1 x global rank). SAVE: a
checkpoint written by ``learner.checkpoint.save_checkpoint``; each LOAD read back by
``load_model_state`` (which verifies it first) into fresh modules. OUT/rank{R}.json: what the
rank's first extra-state ShardedObject is, and what each load gave it.
"""

import json
import os
import pickle
import sys
from pathlib import Path

from mugrpo_megatron.learner.compat_megatron import megatron_on_cpu

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mugrpo_megatron.learner.checkpoint import load_model_state, save_checkpoint

LAYERS, OUT, IN = 2, 4, 3
LAYOUTS = {"tp1": {}, "tp2": {"tensor_model_parallel_size": 2},
           "pp2": {"pipeline_model_parallel_size": 2}, "dp2": {}}


class TELikeLinear(torch.nn.Module):
    """A column-parallel linear whose extra state is in TE 2.x's format: a uint8 tensor of a
    pickled dict of scales and amax histories (``get_extra_state``), unpickled on load only where
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE is "1", as TE 2.17-2.20 does (2.9-2.16 always)."""

    UPSTREAM_DIGESTS = {  # read at TE 2.9.0, 2.11.0 (the first of each) and 2.20.2 (the second)
        "transformer_engine.pytorch.module.base:TransformerEngineBaseModule.get_extra_state": (
            "342b2901d84fc6ed", "7a9afd3ff746ec54"),
        "transformer_engine.pytorch.module.base:TransformerEngineBaseModule.set_extra_state": (
            "2a5a07cfa5dda7a9", "41a2d6a92cf1c6a1"),
    }

    def __init__(self, weight: torch.Tensor, scale: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.scale = scale
        self.loaded: dict | None = None

    def get_extra_state(self) -> torch.Tensor:
        state = {"scale_fwd": torch.full((3,), self.scale),
                 "amax_history_fwd": torch.full((4, 3), self.scale),
                 "extra_fp8_variables": {"num_gemms": 1}}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        if os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") != "1":  # TE >= 2.17
            raise RuntimeError("Refusing to load pickled Transformer Engine extra state")
        self.loaded = pickle.loads(state.numpy().tobytes())  # as TE does (a file we wrote)


class Chunk(torch.nn.Module):
    """This stage's layers, sharded as megatron-core's TE column-parallel layers shard theirs:
    ``make_sharded_tensors_for_checkpoint`` with the weight's TP axis, the layer's global offset
    and the TP and DP groups; dictionary keys local, sharded keys global."""

    def __init__(self, layers: list[int]):
        super().__init__()
        self.global_layers = layers
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), \
            mpu.get_tensor_model_parallel_rank()
        self.layers = torch.nn.ModuleList(
            TELikeLinear(full_weight(g).chunk(tp)[tp_rank].clone(), 1 + g + 0.1 * dist.get_rank())
            for g in layers)

    def sharded_state_dict(self) -> dict:
        out = {}
        for local, g in enumerate(self.global_layers):
            sub = make_sharded_tensors_for_checkpoint(
                self.layers[local].state_dict(prefix="", keep_vars=True), "decoder.layers.fc1.",
                {"weight": 0}, ((0, g, LAYERS),), tp_group=mpu.get_tensor_model_parallel_group(),
                dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True))
            out.update({f"layers.{local}.{k.rsplit('.', 1)[-1]}": v for k, v in sub.items()})
        return out


def full_weight(g: int) -> torch.Tensor:
    return torch.arange(OUT * IN, dtype=torch.float32).view(OUT, IN) + 100 * g


def main() -> None:
    layout, hf, out, save, *loads = sys.argv[1:]
    dist.init_process_group("gloo")
    with megatron_on_cpu():
        mpu.initialize_model_parallel(**LAYOUTS[layout])
    pp, pp_rank = mpu.get_pipeline_model_parallel_world_size(), \
        mpu.get_pipeline_model_parallel_rank()
    mine = list(range(pp_rank * LAYERS // pp, (pp_rank + 1) * LAYERS // pp))
    record: dict = {"rank": dist.get_rank(), "layers": mine, "loads": {}}
    if save != "-":
        sharded = Chunk(mine).sharded_state_dict()
        obj = sharded["layers.0._extra_state"]
        record["extra_state"] = {"type": type(obj).__name__, "replica_id": list(obj.replica_id),
                                 "global_shape": list(obj.global_shape),
                                 "global_offset": list(obj.global_offset)}
        save_checkpoint({"model": sharded}, Path(save), hf_source=Path(hf),
                        state={"counters": {}})
    for ckpt in loads:
        fresh = Chunk(mine)
        for layer in fresh.layers:
            layer.weight.data.zero_()
        load_model_state([fresh], Path(ckpt))
        record["loads"][ckpt] = [{"scale": float(m.loaded["scale_fwd"][0]),
                                  "weight": m.weight.detach().tolist()} for m in fresh.layers]
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

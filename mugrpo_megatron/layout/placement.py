"""Where the rollout engines of a job run: which ranks host an engine, which replica each rank
belongs to and which rank leads it. The fleet, ``plan`` and the dry run read ``Placement``
instead of working it out. No process group here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from mugrpo_megatron.config import RolloutConfig


@dataclass(frozen=True)
class Placement:
    """Where the rollout engines of a job run (``rollout.placement``, with 'auto' resolved)."""

    engine: str
    kind: Literal["spmd", "node", "rank0"]
    """'spmd': every rank hosts one tensor-parallel rank of a replica (vLLM's external launcher);
    'node': each node's first rank starts an engine with processes of its own (SGLang); 'rank0':
    one engine on global rank 0 (also spmd on a world of one rank: the plain in-process engine)."""
    tensor_parallel: int
    world_size: int
    ranks_per_node: int

    @property
    def replicas(self) -> int:
        if self.kind == "spmd":
            return self.world_size // self.tensor_parallel
        if self.kind == "node":
            return self.world_size // self.ranks_per_node
        return 1

    def replica(self, rank: int) -> int:
        """The replica ``rank`` belongs to (generates a share of a phase with)."""
        if self.kind == "spmd":
            return rank // self.tensor_parallel
        return rank // self.ranks_per_node if self.kind == "node" else 0

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` scores and persists its replica's answers."""
        if self.kind == "spmd":
            return rank % self.tensor_parallel == 0
        return rank % self.ranks_per_node == 0 if self.kind == "node" else rank == 0

    def hosts(self, rank: int) -> bool:
        """Whether ``rank`` starts (a tensor-parallel rank of) an engine."""
        return self.kind == "spmd" or self.leads(rank)

    @property
    def nodes_per_replica(self) -> int:
        """Nodes one replica's tensor-parallel group spans (1: it stays within a node)."""
        return max(1, self.tensor_parallel // self.ranks_per_node) if self.kind == "spmd" else 1

    def describe(self) -> str:
        if self.kind == "spmd":
            spans = (f", each spanning {self.nodes_per_replica} nodes"
                     if self.nodes_per_replica > 1 else "")
            return (f"{self.replicas} {self.engine} replica(s) at TP {self.tensor_parallel}"
                    f"{spans}, one engine TP rank on every rank")
        if self.kind == "node":
            return (f"{self.replicas} {self.engine} engine(s) at TP {self.tensor_parallel}, one "
                    f"per node (on each node's first rank)")
        return f"one {self.engine} engine at TP {self.tensor_parallel}, on global rank 0"


def launcher_ranks_per_node() -> int | None:
    """Processes per node as torchrun reports them (``LOCAL_WORLD_SIZE``: one per GPU on a GPU
    cluster); None when not launched by torchrun."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


def placement(r: RolloutConfig, world_size: int, ranks_per_node: int | None = None) -> Placement:
    """Where ``r``'s engines run in a job of ``world_size`` ranks, ``ranks_per_node`` a node (the
    whole world when not known). ValueError if the replicas do not tile the ranks, or if a
    replica would take part of a node beyond its own: a vLLM replica (spmd) takes part of one
    node or whole nodes (TP 16 on nodes of 8: two), an SGLang engine (node) one node at most."""
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"--gpus-per-node: {ranks_per_node} must be at least 1")
    per_node = min(ranks_per_node or world_size, world_size)  # a job smaller than a node
    if world_size % per_node:
        raise ValueError(f"{world_size} ranks do not split into nodes of {per_node} (torchrun's "
                         f"LOCAL_WORLD_SIZE, or --gpus-per-node)")
    if ranks_per_node is not None and not r.spmd and r.tensor_parallel > ranks_per_node:
        raise ValueError(f"rollout.tensor_parallel: {r.tensor_parallel} must not exceed the "
                         f"{ranks_per_node} GPUs per node with {r.engine} (placement node): the "
                         f"fleet starts one engine a node, in that node's processes; a replica "
                         f"larger than a node is vLLM's (placement spmd)")
    if ranks_per_node is not None and r.spmd and (
            ranks_per_node % r.tensor_parallel if r.tensor_parallel <= ranks_per_node
            else r.tensor_parallel % ranks_per_node):
        raise ValueError(f"rollout.tensor_parallel: {r.tensor_parallel} must divide the "
                         f"{ranks_per_node} GPUs per node, or be a multiple of them: an engine "
                         f"replica takes part of one node or whole nodes")
    if r.spmd and world_size % r.tensor_parallel:
        raise ValueError(f"rollout.tensor_parallel: {r.tensor_parallel} must divide the "
                         f"world size {world_size} with placement spmd (each engine replica "
                         f"spans {r.tensor_parallel} of the job's ranks"
                         + ("; launch through torchrun with at least that many processes"
                            if world_size < r.tensor_parallel else "") + ")")
    kind = "spmd" if r.spmd and world_size > 1 else "node" if r.per_node else "rank0"
    return Placement(r.engine, kind, r.tensor_parallel, world_size, per_node)

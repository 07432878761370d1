"""Weight sync as a collective: every learner rank streams, the engine's rank loads.

The stream (``learner.export.iter_hf_tensors``) is collective, so every rank must run it to the end
even when the engine refuses a tensor part way; the outcome is then agreed on all ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from mugrpo_megatron.engines.base import RolloutEngine, WeightSyncStats


def push_weights(engine: RolloutEngine | None, weights: Iterator[tuple[str, torch.Tensor]]
                 ) -> tuple[WeightSyncStats | None, str]:
    """Load ``weights`` into ``engine`` (None on ranks without one); returns (stats, error) with
    the same error text on every rank ('' on success)."""
    stats, error = None, ""
    if engine is not None:
        try:
            stats = engine.update_weights(weights)
        except Exception as e:  # noqa: BLE001 - agreed on and raised by the caller on all ranks
            error = f"{type(e).__name__}: {e}"
    for _ in weights:  # the other ranks, and this one after a refusal, finish the collectives
        pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    return stats, error

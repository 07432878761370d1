"""The engine fleet without an engine process: what it refuses before any sampling."""

import pytest

from mugrpo_megatron.config import RolloutConfig
from mugrpo_megatron.engines import SamplingSpec
from mugrpo_megatron.engines.fleet import EngineFleet


def test_placeholder_weights_are_never_sampled():
    """Engines started without the checkpoint's weights (as the trainer starts them) refuse to
    generate until a weight sync has filled them."""
    fleet = EngineFleet(None, RolloutConfig())
    fleet.has_weights = False
    with pytest.raises(RuntimeError, match="hold none of the learner's weights"):
        fleet.generate([[1, 2, 3]], SamplingSpec(n=1, max_new_tokens=4))
    with pytest.raises(RuntimeError, match="sync the learner's weights first"):
        fleet.check_has_weights()
    assert fleet.update_weights(iter([])) is None and fleet.has_weights  # no engine here
    assert fleet.generate([[1, 2, 3]], SamplingSpec(n=1, max_new_tokens=4)) is None  # no engine


def test_a_replica_queues_twice_what_its_engine_runs_not_its_share():
    """rollout.max_inflight_prompts: 0 queues ceil(2 x running sequences / G) prompts in an engine
    that refills its batch (vLLM), whatever the share; an explicit setting wins; an engine
    without a step API (SGLang) takes windows of a shard; an engine that cannot say what it runs
    gets the whole share (0)."""
    from mugrpo_megatron.engines.fleet import inflight_prompts

    h100 = RolloutConfig(group_size=8)
    assert inflight_prompts(h100, True, 1024) == 256  # vLLM's default on H100/H200
    assert inflight_prompts(RolloutConfig(group_size=3), True, 256) == 171
    assert inflight_prompts(RolloutConfig(group_size=8, max_inflight_prompts=5000), True, 1024) \
        == 5000
    assert inflight_prompts(RolloutConfig(engine="sglang", shard_prompts=64), False, None) == 64
    assert inflight_prompts(h100, True, None) == 0

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
    with pytest.raises(RuntimeError, match="none have been streamed into them yet"):
        fleet.generate([[1, 2, 3]], SamplingSpec(n=1, max_new_tokens=4))
    with pytest.raises(RuntimeError, match="sync the learner's weights first"):
        fleet.check_has_weights()
    stats, error = fleet.update_weights(iter([]))
    assert error == "" and fleet.has_weights
    assert fleet.generate([[1, 2, 3]], SamplingSpec(n=1, max_new_tokens=4)) is None  # no engine

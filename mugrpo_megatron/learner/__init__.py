"""The megatron-core learner: model building, parallel layout, log-probs, train step, checkpoints.

megatron.core is imported only under this package (and by nothing outside the learner and the
resharding in ``export.py``).
"""

# megatron-core is imported through its compat module first (part 6 there: no compiled fusions
# on CPU), whichever learner module is imported
from mugrpo_megatron.learner import compat_megatron as _compat_megatron  # noqa: F401

"""The megatron-core learner: model building, parallel layout, log-probs, train step, checkpoints.

megatron.core is imported only under this package (and by nothing outside the learner and the
resharding in ``export.py``).
"""

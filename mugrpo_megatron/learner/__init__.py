"""The megatron-core learner: model building, parallel layout, log-probs, train step, checkpoints.

megatron.core is imported only under this package (and by nothing outside the learner and the
resharding in ``export.py``). Every module here that imports megatron-core imports
``compat_megatron`` first (its part 6: no compiled fusions on a machine without CUDA); ruff keeps
that order (``pyproject.toml``, the isort section "megatron-compat"). Modules without megatron
(``fp8``, ``packing``) stay light: the dry run reads them without importing it; the model
families, their specs and the HF name mapping are in ``mugrpo_megatron.models``.
"""

"""The model families: every fact about a supported Hugging Face architecture, with no megatron.

- ``hf_config``: ``FAMILIES`` (what each architecture's config.json does not say), ``ModelSpec``
  (a config.json as the numbers everything else needs: the learner, the engines, the dry run),
  ``read_model_spec`` and the model directory's tokenizer files;
- ``mapping``: the names and layouts of every HF tensor in megatron-core's GPTModel (TP, PP, EP
  shards), both ways;
- ``tiny``: tiny random checkpoints and tokenizers of every family, for the tests and benchmarks.

Adding a family of the supported shape (an RMSNorm, SwiGLU, RoPE decoder, dense or with SwiGLU
experts) is one ``FAMILIES`` entry and one ``tiny.TINY_FAMILIES`` entry; the tests take their
family list from those. ``learner/model.py`` turns a ``ModelSpec`` into megatron-core's
arguments.
"""

from mugrpo_megatron.models.hf_config import FAMILIES, TOKENIZER_FILES, ModelSpec, read_model_spec

__all__ = ["FAMILIES", "TOKENIZER_FILES", "ModelSpec", "read_model_spec"]

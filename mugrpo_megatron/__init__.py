"""mugrpo_megatron: Mu-GRPO on Megatron-core learners with vLLM/SGLang rollouts."""

__version__ = "0.1.0"

"""Prompt datasets: reading rows from files (``readers``), checking and tokenizing them
(``loading``), the builtin arithmetic task (``arithmetic``), and the training prompts as one
mapped Arrow file (``prompt_store``)."""

from mugrpo_megatron.data.loading import (
    PromptChunk,
    Tokenizer,
    gold_answer,
    iter_prompt_chunks,
    load_eval_sets,
    load_prompts,
    render_prompts,
    tokenize_prompt,
    tokenize_prompts,
)
from mugrpo_megatron.data.readers import BUILTIN_ARITHMETIC, CHUNK_ROWS, BadRow

__all__ = ["BUILTIN_ARITHMETIC", "CHUNK_ROWS", "BadRow", "PromptChunk", "Tokenizer", "gold_answer",
           "iter_prompt_chunks", "load_eval_sets", "load_prompts", "render_prompts",
           "tokenize_prompt", "tokenize_prompts"]

"""Tiny, self-made Hugging Face tokenizers and checkpoints for tests and benchmarks (no download).

The tokenizer is a byte-level BPE trained here on a little text, with a ChatML chat template, saved
as a ``PreTrainedTokenizerFast`` directory, so the code under test sees a real HF tokenizer.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "What is 12 + 7? Put your final answer within \\boxed{}.",
    "The answer is \\boxed{19}. We add the numbers: 12 + 7 = 19.",
    "user assistant system You are a helpful assistant.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * = ? #### .",
    "There are 15 trees in the grove. How many trees did the grove workers plant today?",
]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """Train and save a small byte-level BPE tokenizer with a ChatML template; returns it loaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None, unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast

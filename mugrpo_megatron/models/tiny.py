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


# family -> HF config overrides for a tiny random model. head_dim 32 is one vLLM's CPU attention has.
TINY_FAMILIES: dict[str, dict] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
    # YaRN (Qwen3's long-context setting) from 64 positions to 512: rotations differ from plain
    # RoPE from position 1 on, and q.k is scaled by (0.1 ln 8 + 1)^2
    "qwen3_yarn": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
                   "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                    "original_max_position_embeddings": 64}},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": None},
    # mixtures of experts: 4 experts, top-2
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    # GLM-4.5's MoE (DeepSeek-V3's): sigmoid scores with a correction bias, top-2 renormalised
    # and scaled by 2.5, 4 experts in 2 groups of which a token's experts come from 1, a shared
    # expert, layer 0 dense; QKV bias, q/k norm, RoPE on half of each head
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                 "head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 64, "n_shared_experts": 1, "first_k_dense_replace": 1,
                 "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 2,
                 "topk_group": 1, "attention_bias": True, "use_qk_norm": True,
                 "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 0},
    # DeepSeek-V3: GLM-4.5's MoE under multi-latent attention, a query latent of 64 and the
    # key/value latent of 512 + a rotary key of 64 (the one size vLLM's CPU MLA kernel takes),
    # 32 + 64 query/key and 32 value dimensions a head; V3's YaRN (mscale = mscale_all_dim = 1:
    # the softmax scaled by (0.1 ln 4 + 1)^2) from 128 positions to 512
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 2,
                    "topk_group": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                    "q_lora_rank": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 32, "v_head_dim": 32, "num_nextn_predict_layers": 0,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 128}},
}


def make_tiny_checkpoint(out_dir: str | Path, family: str = "llama", *, seed: int = 0,
                         vocab_size: int = 400, num_layers: int = 4, hidden_size: int = 128,
                         num_heads: int = 4, num_kv_heads: int = 2, ffn_hidden_size: int = 256,
                         tie_embeddings: bool = False, init_std: float = 0.08,
                         max_position_embeddings: int = 512, dtype: str = "float32") -> Path:
    """Save a random tiny HF model of ``family`` (safetensors, config.json, tokenizer) to ``out_dir``.

    ``vocab_size`` is deliberately not a multiple of 128 so that megatron pads it. A larger
    ``init_std`` than HF's default gives peaked, non-uniform next-token distributions, which makes
    log-prob comparisons meaningful.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    out = Path(out_dir)
    tokenizer = make_tokenizer(out)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)})")
    overrides = dict(TINY_FAMILIES[family])
    model_type = overrides.pop("model_type")
    if "kv_lora_rank" in overrides:  # MLA: HF counts every query head as a KV head
        num_kv_heads = num_heads
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_embeddings, initializer_range=init_std, rms_norm_eps=1e-6,
        rope_theta=10000.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, torch_dtype=dtype, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, dtype))
    with torch.no_grad():  # random, not-quite-unit norms so that norm weights matter in the tests
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight") and not p.any():  # GLM's router starts at zero
                p.normal_(0.0, init_std)
        for name, b in model.named_buffers():  # an expert bias that changes which experts win
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


TOOL_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
"""The call ``teach_tool_calls`` teaches (Hermes format: Qwen2.5/Qwen3's)."""


def teach_tool_calls(hf_dir: str | Path, prompts: list[str], *, steps: int = 150,
                     seed: int = 0) -> Path:
    """Fine-tune a tiny checkpoint in place so that it answers a chat-templated prompt with the
    python tool call ``TOOL_CALL`` and a tool's message with ``\\boxed{42}``, each ended by its
    EOS: a policy that calls tools, sampled mostly as taught (temperature 1 still draws other
    tokens now and then: malformed calls, text without a call). Trains on its own turns only,
    the tool message's tokens rendered by ``trajectory.render``, a few seconds on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mugrpo_megatron.trajectory.render import TurnRenderer
    from mugrpo_megatron.trajectory.tools import PYTHON_SCHEMA

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    renderer = TurnRenderer(tok, [PYTHON_SCHEMA])
    call = tok(TOOL_CALL + tok.eos_token, add_special_tokens=False)["input_ids"]
    answer = tok("\\boxed{42}" + tok.eos_token, add_special_tokens=False)["input_ids"]
    rows = []
    for text in prompts:
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": text}],
                                             tools=[PYTHON_SCHEMA], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"]
        result = renderer.tool_ids([("python", "42\n")])
        ids = prompt + call + result + answer
        learn = [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(answer)
        rows.append((ids, learn))
    width = max(len(ids) for ids, _ in rows)
    tokens = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.bool)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(tokens).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], tokens[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    return Path(hf_dir)

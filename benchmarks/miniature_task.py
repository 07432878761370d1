"""The miniature's task and starting policy: chained single-digit arithmetic, solved step by step by
a tiny Llama that supervised fine-tuning stops on the way to learning it.

Task: ``Q: 7+5-8+3`` -> `` 7+5=12, 12-8=4, 4+3=7. \\boxed{7}``; 2 to 5 operands from 1-9, so a
worked response runs 15-45 tokens (one token per character) and a wrong step early leaves a long
suffix. Half of the SFT examples are worked that way, half answer at once (`` \\boxed{7}``), so the
policy starts with two behaviours: working step by step, right with about p^(k-1) for k operands
when it gets a step right with probability p, and guessing, right mostly on short problems. The
pass rate so varies across prompts (most groups of 8 are mixed and carry a signal), and RL has
something to learn that generalises across prompts: when to work the steps. This is the kind of
improvement RL makes in real LLMs, which choose among behaviours pretraining gave them; the tiny
model could not learn new arithmetic facts from a sparse reward within a CPU budget (tried: with
worked examples only, held-out accuracy stayed flat over 128 updates of 64 responses).

Policy: a Llama-shaped model (2 layers, hidden 128, head size 32, which vLLM's CPU attention
supports), initialised at random and trained here with AdamW on teacher-forced examples until
its sampled pass rate (temperature 1, the way RL samples) on a probe set first reaches the target.
The tokenizer is a byte-level BPE with no merges: one token per byte, digits included.

Nothing here is part of the package: it only makes the starting point of a benchmark.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT_TEMPLATE = "Q: {prompt}\nA:"


@dataclass(frozen=True)
class Problem:
    question: str
    """The expression, e.g. '7+5-8+3'."""
    solution: str
    """The worked response, step by step, ending in the boxed answer."""
    direct: str
    """The answer alone, boxed: the shortcut the SFT also teaches."""
    answer: str
    operands: int


def make_problem(rng: random.Random, min_operands: int = 2, max_operands: int = 5) -> Problem:
    k = rng.randint(min_operands, max_operands)
    nums = [rng.randint(1, 9) for _ in range(k)]
    ops = [rng.choice("+-") for _ in range(k - 1)]
    value, steps = nums[0], []
    for op, n in zip(ops, nums[1:]):
        new = value + n if op == "+" else value - n
        steps.append(f"{value}{op}{n}={new}")
        value = new
    question = str(nums[0]) + "".join(f"{op}{n}" for op, n in zip(ops, nums[1:]))
    return Problem(question, " " + ", ".join(steps) + f". \\boxed{{{value}}}",
                   f" \\boxed{{{value}}}", str(value), k)


def write_splits(out_dir: Path, *, seed: int, num_train: int, num_eval: int, num_probe: int,
                 max_operands: int = 5) -> dict[str, list[Problem]]:
    """Disjoint train / held-out / probe problems (by question), written as JSON lines with the
    package's default fields (question, answer); returns them."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[Problem]] = {}
    for name, n in (("eval", num_eval), ("probe", num_probe), ("train", num_train)):
        rows: list[Problem] = []
        while len(rows) < n:
            p = make_problem(rng, max_operands=max_operands)
            if name == "train" or p.question not in seen:  # held-out and probe stay unseen
                if name != "train":
                    seen.add(p.question)
                elif p.question in seen:
                    continue
                rows.append(p)
        splits[name] = rows
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for p in rows:
                f.write(json.dumps({"question": p.question, "answer": p.answer}) + "\n")
    return splits


def make_tokenizer(out_dir: Path):
    """A byte-level tokenizer with no merges (one token per byte) and the ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(SPECIAL_TOKENS),
                                  special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(["0123456789"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None, unk_token=None)
    fast.save_pretrained(str(out_dir))
    return fast


@dataclass
class SftResult:
    path: Path
    steps: int
    seconds: float
    probe_pass_rate: float
    probe_by_operands: dict[int, float]
    history: list[dict]


def sft_policy(out_dir: Path, train: list[Problem], probe: list[Problem], *, target: float,
               seed: int = 0, lr: float = 3e-3, batch: int = 128, check_every: int = 100,
               direct_frac: float = 0.5,
               max_steps: int = 4000, log=print) -> SftResult:
    """Train the tiny Llama on ``train`` until its sampled pass rate on ``probe`` first reaches
    ``target``; save it (safetensors, config, tokenizer) to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # teacher-forced sequences, tokenized once: prompt, then solution and end-of-sequence
    seqs, starts = [], []
    rng = random.Random(seed)
    for p in train:
        prompt = tok(PROMPT_TEMPLATE.format(prompt=p.question))["input_ids"]
        response = p.direct if rng.random() < direct_frac else p.solution
        seqs.append(prompt + tok(response)["input_ids"] + [tok.eos_token_id])
        starts.append(len(prompt))
    history: list[dict] = []
    t0 = time.perf_counter()
    rate, by_k = 0.0, {}
    for step in range(1, max_steps + 1):
        rows = rng.sample(range(len(seqs)), batch)
        loss = sft_loss(model, [seqs[i] for i in rows], [starts[i] for i in rows],
                        tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0:
            rate, by_k = probe_pass_rate(model, tok, probe)
            history.append({"step": step, "loss": loss.item(), "probe_pass_rate": rate,
                            "seconds": time.perf_counter() - t0})
            log(f"sft step {step}: loss {loss.item():.3f}, probe pass rate {rate:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
            if rate >= target:
                break
    else:
        raise RuntimeError(f"SFT did not reach a probe pass rate of {target} in {max_steps} steps "
                           f"(last {rate:.3f})")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return SftResult(out_dir, step, time.perf_counter() - t0, rate, by_k, history)


def sft_loss(model, seqs: list[list[int]], starts: list[int], pad_id: int, chunks: int = 4):
    """Mean next-token loss over the response tokens of ``seqs`` (from ``starts[i]`` on).

    The rows are sorted by length and run in ``chunks`` forward passes, each padded only to its
    own longest row: the examples run 20-68 tokens (median 27, mean 34), so one batch padded to
    its longest row is half padding, and four chunks take 0.43-0.46 s a step (forward and
    backward, one thread) against 0.73-0.84 s in one batch, for the same loss (attention is
    causal and the padding is on the right, so no response token sees it; only the order of the
    float sums differs)."""
    import torch

    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    size = -(-len(order) // chunks)
    total, count = 0.0, 0
    for part in (order[k:k + size] for k in range(0, len(order), size)):
        width = len(seqs[part[-1]])
        ids = torch.full((len(part), width), pad_id)
        mask = torch.zeros(len(part), width)
        for b, i in enumerate(part):
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
            mask[b, starts[i]:len(seqs[i])] = 1.0
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                                reduction="none")
        total = total + (nll * mask[:, 1:]).sum()
        count += int(mask[:, 1:].sum())
    return total / count


def probe_pass_rate(model, tok, probe: list[Problem], max_new_tokens: int = 64
                    ) -> tuple[float, dict[int, float]]:
    """Sampled (temperature 1, no top-k/p) pass rate on ``probe``, overall and by operand count.
    A response passes when its last box holds the answer, as the package's math reward checks."""
    import torch

    from mugrpo_megatron.rewards.math_answer import extract_answer

    model.eval()
    tok.padding_side = "left"
    enc = tok([PROMPT_TEMPLATE.format(prompt=p.question) for p in probe], return_tensors="pt",
              padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    model.train()
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    ok = [extract_answer(t) == p.answer for t, p in zip(texts, probe)]
    by_k: dict[int, list[bool]] = {}
    for o, p in zip(ok, probe):
        by_k.setdefault(p.operands, []).append(o)
    return sum(ok) / len(ok), {k: sum(v) / len(v) for k, v in sorted(by_k.items())}

"""The tool miniature's task and starting policy: two-digit multiplication, which the tiny Llama
cannot do in its head but can with the python tool.

Task: ``What is 47*86?`` (a ChatML user turn) -> either the tool path, a python call
``<tool_call>{"name":"python","arguments":{"code":"print(47*86)"}}</tool_call>``, the sandbox's
``4042`` back as the template's tool message, then ``\\boxed{4042}``; or the direct path,
``\\boxed{...}`` at once. Factors 10-99 (8,100 problems, products of 3-4 digits), scored by the
math reward on the model's own text (tool messages left out). The SFT teaches both paths, half
each, on the true answers: the direct path is a guess the tiny model gets right a few percent
of the time (near products it memorised), the tool path right whenever it copies the factors
into the call and the printed product into its box. So the policy starts calling the tool on
about half the problems, and RL has a behaviour to choose: call the tool. Without tools
(``rollout.tools: []``) a call gets no answer and the turn ends without a box: only guessing
pays.

Policy: the arithmetic miniature's byte-level tokenizer (``miniature_task``) with a ChatML chat
template, a Llama of ``LAYERS`` layers, trained on teacher-forced two-turn examples (the loss on
the model's own tokens; the tool message's tokens, rendered by the package's
``trajectory.render``, in the context only) until its sampled two-turn accuracy on a probe set,
the calls run in the OS sandbox as training runs them, first reaches the target.

Nothing here is part of the package: it only makes the starting point of a benchmark.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import miniature_task

LAYERS = 2
MAX_NEW_TOKENS = 160
"""The longest two-turn trajectory (call, tool message, box: ~130 tokens) with room: the probe's
and the runs' ``rollout.max_new_tokens``."""
CALL = '<tool_call>{{"name":"python","arguments":{{"code":"print({a}*{b})"}}}}</tool_call>'


@dataclass(frozen=True)
class ToolProblem:
    question: str
    a: int
    b: int

    @property
    def answer(self) -> str:
        return str(self.a * self.b)


def make_problem(rng: random.Random) -> ToolProblem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return ToolProblem(f"What is {a}*{b}?", a, b)


def write_splits(out_dir: Path, *, seed: int, num_train: int, num_eval: int,
                 num_probe: int) -> dict[str, list[ToolProblem]]:
    """Disjoint held-out and probe problems (by question), train drawn from the rest, as JSON
    lines (question, answer)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[ToolProblem]] = {}
    for name, n in (("eval", num_eval), ("probe", num_probe), ("train", num_train)):
        rows: list[ToolProblem] = []
        while len(rows) < n:
            p = make_problem(rng)
            if p.question in seen:
                continue
            if name != "train":
                seen.add(p.question)
            rows.append(p)
        splits[name] = rows
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for p in rows:
                f.write(json.dumps({"question": p.question, "answer": p.answer}) + "\n")
    return splits


def make_tokenizer(out_dir: Path):
    """``miniature_task``'s one-token-a-byte tokenizer with a ChatML chat template."""
    from mugrpo_megatron.models.tiny import CHATML_TEMPLATE

    tok = miniature_task.make_tokenizer(out_dir)
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(out_dir))
    return tok


def _prompt(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sft_policy(out_dir: Path, train: list[ToolProblem], probe: list[ToolProblem], *,
               target: float, seed: int = 0, lr: float = 3e-3, batch: int = 64,
               check_every: int = 100, direct_frac: float = 0.5, max_steps: int = 4000,
               log=print) -> miniature_task.SftResult:
    """Train the tiny Llama on ``train`` until its sampled two-turn accuracy on ``probe`` first
    reaches ``target``; save it to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mugrpo_megatron.trajectory.render import TurnRenderer
    from mugrpo_megatron.trajectory.tools import PYTHON_SCHEMA

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir)
    renderer = TurnRenderer(tok, [PYTHON_SCHEMA])
    config = LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=320,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / max_steps))
    rng = random.Random(seed)
    eos = tok.eos_token_id
    seqs, masks = [], []
    for p in train:
        prompt = _prompt(tok, p.question)
        box = _ids(tok, f"\\boxed{{{p.answer}}}") + [eos]
        if rng.random() < direct_frac:
            parts = [(prompt, 0), (box, 1)]
        else:
            call = _ids(tok, CALL.format(a=p.a, b=p.b)) + [eos]
            result = renderer.tool_ids([("python", f"{p.answer}\n")])
            parts = [(prompt, 0), (call, 1), (result, 0), (box, 1)]
        seqs.append([t for ids, _ in parts for t in ids])
        masks.append([m for ids, m in parts for _ in ids])
    history: list[dict] = []
    t0 = time.perf_counter()
    score = 0.0
    for step in range(1, max_steps + 1):
        rows = rng.sample(range(len(seqs)), batch)
        width = max(len(seqs[i]) for i in rows)
        ids = torch.tensor([seqs[i] + [tok.pad_token_id] * (width - len(seqs[i])) for i in rows])
        mask = torch.tensor([masks[i] + [0] * (width - len(masks[i])) for i in rows],
                            dtype=torch.bool)
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % check_every == 0:
            score, calls = probe_score(model, tok, renderer, probe)
            history.append({"step": step, "loss": loss.item(), "probe_score": score,
                            "probe_call_rate": calls, "seconds": time.perf_counter() - t0})
            log(f"sft step {step}: loss {loss.item():.3f}, probe accuracy {score:.3f}, calls "
                f"{calls:.2f} ({time.perf_counter() - t0:.0f}s)")
            if score >= target:
                break
    else:
        raise RuntimeError(f"SFT did not reach a probe accuracy of {target} in {max_steps} steps "
                           f"(last {score:.3f})")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return miniature_task.SftResult(out_dir, step, time.perf_counter() - t0, score, {}, history)


def _sample(model, tok, inputs: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import torch

    width = max(map(len, inputs))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in inputs])
    attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in inputs])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    rows = []
    for row in out[:, width:].tolist():
        cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        rows.append(row[:cut])
    return rows


def probe_score(model, tok, renderer, probe: list[ToolProblem]) -> tuple[float, float]:
    """Sampled (temperature 1) two-turn accuracy on ``probe`` and the share of first turns that
    call the tool: each call parsed and run in the OS sandbox, its output rendered as the
    template's tool message, the second turn sampled after it; scored by the math reward."""
    from mugrpo_megatron.rewards.math_answer import math_reward
    from mugrpo_megatron.rewards.sandbox_spec import SandboxSpec
    from mugrpo_megatron.trajectory.calls import parse_calls
    from mugrpo_megatron.trajectory.tools import _run_python

    model.eval()
    prompts = [_prompt(tok, p.question) for p in probe]
    first = _sample(model, tok, prompts, 100)
    texts, follow, at = [], [], []
    for k, turn in enumerate(first):
        text = tok.decode(turn, skip_special_tokens=False)
        calls = parse_calls(text, "hermes")
        texts.append(tok.decode(turn, skip_special_tokens=True))
        if calls and not calls[0].error and calls[0].name == "python" and \
                turn and turn[-1] == tok.eos_token_id:
            _, out = _run_python(calls[0].arguments.get("code"), SandboxSpec())
            follow.append(prompts[k] + turn + renderer.tool_ids([("python", out)]))
            at.append(k)
    if follow:
        for k, turn in zip(at, _sample(model, tok, follow, 20)):
            texts[k] += tok.decode(turn, skip_special_tokens=True)
    model.train()
    score = sum(math_reward(t, p.answer) for t, p in zip(texts, probe)) / len(probe)
    return score, len(at) / len(probe)


_BOX = re.compile(r"\\boxed\{")

"""The code miniature's task and starting policy: a tiny Llama writes a Python function from three
of its values, and the program is run on hidden test cases in the OS sandbox.

Task: ``Q: f(0)=8, f(1)=11, f(2)=14`` -> a fenced program defining ``f``, scored by the
package's code reward (``reward.name: code``) on four hidden cases (x = 3, 5, 7, 10; the
function-call layout, ``"fn_name": "f"``), a program scoring the share of them it gets right.
Every function is ``a*x+b`` (a 1-9, b 0-99: 900 functions), shown at x = 0, 1, 2, so b is read
off f(0) and a is f(1)-f(0), which the units digits alone decide (a < 10): a rule over 90 digit
pairs. As in the arithmetic miniature (``miniature_task``), half of the
SFT examples work it out in a comment before the return (``# a=11-8=3, b=8``) and half write
the return at once, so the policy starts with two behaviours, working and guessing, right at
different rates, and RL has something to learn that generalises across prompts. A response
runs 35-67 tokens (one token a byte).

Policy: the arithmetic miniature's tiny Llama and byte-level tokenizer (``miniature_task``),
trained on teacher-forced examples until its sampled mean score (temperature 1, each program
run in the sandbox as training runs it) on a probe set first reaches the target. The learning
rate warms up over 100 steps and decays linearly to 5% at ``max_steps``: at the arithmetic
miniature's constant 3e-3 this task's loss spiked and the probe score stalled at 0.05-0.14 for
4,000 steps; with the decay the committed policy first crossed 0.3 at step 1,025
(``code_policy/sft.json``).

Nothing here is part of the package: it only makes the starting point of a benchmark.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import miniature_task

PROMPT_TEMPLATE = miniature_task.PROMPT_TEMPLATE
SHOWN = (0, 1, 2)
"""The x a prompt shows f at."""
HIDDEN = (3, 5, 7, 10)
"""The test cases' inputs: never shown."""
MAX_NEW_TOKENS = 72
"""Room for the longest worked program (66 tokens and the end of sequence): the probe's and the
runs' ``rollout.max_new_tokens``. A cut program is no program (its fence is open), so a smaller
limit would score the longest right answers 0."""


@dataclass(frozen=True)
class CodeProblem:
    question: str
    """The shown values, e.g. 'f(2)=8, f(3)=11, f(4)=14'."""
    solution: str
    """The worked program: a and b in a comment, then the return."""
    direct: str
    """The program with the return alone."""
    answer: str
    """The test cases, as the code reward reads them (JSON, function-call layout)."""


def program(comment: str, a: int, b: int) -> str:
    return f" ```python\ndef f(x):\n{comment}    return x*{a}+{b}\n```"


def make_problem(rng: random.Random) -> CodeProblem:
    a, b = rng.randint(1, 9), rng.randint(0, 99)
    f = {x: a * x + b for x in (*SHOWN, *HIDDEN)}
    question = ", ".join(f"f({x})={f[x]}" for x in SHOWN)
    work = f"    # a={f[1]}-{f[0]}={a}, b={f[0]}\n"
    cases = json.dumps({"fn_name": "f", "inputs": [[x] for x in HIDDEN],
                        "outputs": [f[x] for x in HIDDEN]})
    return CodeProblem(question, program(work, a, b), program("", a, b), cases)


def write_splits(out_dir: Path, *, seed: int, num_train: int, num_eval: int,
                 num_probe: int) -> dict[str, list[CodeProblem]]:
    """Disjoint train / held-out / probe problems (by question: 900 exist; the held-out and probe
    ones are never trained on) as JSON lines (question, answer)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[CodeProblem]] = {}
    for name, n in (("eval", num_eval), ("probe", num_probe), ("train", num_train)):
        rows: list[CodeProblem] = []
        while len(rows) < n:
            p = make_problem(rng)
            if name == "train":
                if p.question not in seen:
                    rows.append(p)
            elif p.question not in seen:
                seen.add(p.question)
                rows.append(p)
        splits[name] = rows
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for p in rows:
                f.write(json.dumps({"question": p.question, "answer": p.answer}) + "\n")
    return splits


def sft_policy(out_dir: Path, train: list[CodeProblem], probe: list[CodeProblem], *,
               target: float, seed: int = 0, lr: float = 3e-3, batch: int = 128,
               check_every: int = 25, direct_frac: float = 0.5, max_steps: int = 1500,
               log=print) -> miniature_task.SftResult:
    """Train the tiny Llama on ``train`` until its sampled mean score on ``probe`` first reaches
    ``target``; save it to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = miniature_task.make_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * max(0.05, 1 - s / max_steps))
    rng = random.Random(seed)
    seqs, starts = [], []
    for p in train:
        prompt = tok(PROMPT_TEMPLATE.format(prompt=p.question))["input_ids"]
        response = p.direct if rng.random() < direct_frac else p.solution
        seqs.append(prompt + tok(response)["input_ids"] + [tok.eos_token_id])
        starts.append(len(prompt))
    history: list[dict] = []
    t0 = time.perf_counter()
    score = 0.0
    for step in range(1, max_steps + 1):
        rows = rng.sample(range(len(seqs)), batch)
        loss = miniature_task.sft_loss(model, [seqs[i] for i in rows],
                                       [starts[i] for i in rows], tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % check_every == 0:
            score = probe_score(model, tok, probe)
            history.append({"step": step, "loss": loss.item(), "probe_score": score,
                            "seconds": time.perf_counter() - t0})
            log(f"sft step {step}: loss {loss.item():.3f}, probe score {score:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
            if score >= target:
                break
    else:
        raise RuntimeError(f"SFT did not reach a probe score of {target} in {max_steps} steps "
                           f"(last {score:.3f})")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return miniature_task.SftResult(out_dir, step, time.perf_counter() - t0, score, {}, history)


def probe_score(model, tok, probe: list[CodeProblem],
                max_new_tokens: int = MAX_NEW_TOKENS) -> float:
    """Sampled (temperature 1) mean code-reward score on ``probe``: every program run in the
    sandbox with the package's default limits, as training scores it."""
    import torch

    from mugrpo_megatron.rewards.code import code_reward
    from mugrpo_megatron.rewards.sandbox import SandboxSpec

    model.eval()
    tok.padding_side = "left"
    enc = tok([PROMPT_TEMPLATE.format(prompt=p.question) for p in probe], return_tensors="pt",
              padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    model.train()
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    spec = SandboxSpec()
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda tp: code_reward(tp[0], tp[1].answer, sandbox=spec),
                               zip(texts, probe)))
    return sum(scores) / len(scores)

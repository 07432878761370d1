"""Generation through our engine wrapper against bare vLLM, same engine, prompts and sampling.

    python benchmarks/engine_overhead.py [--model tiny|DIR] [--prompts 64] [--n 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import summarize, table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_overhead.json"))
    args = ap.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from mugrpo_megatron.config import RolloutConfig
    from mugrpo_megatron.engines import SamplingSpec, make_engine

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model)
        if args.model == "tiny":
            from mugrpo_megatron.models.tiny import make_tiny_checkpoint

            model = make_tiny_checkpoint(Path(tmp) / "m", "llama", hidden_size=256,
                                         ffn_hidden_size=704, num_heads=4, vocab_size=4096)
        engine = make_engine(RolloutConfig(), model, dtype="float32", max_model_len=256)
        prompts = [[5 + (i * 7 + j) % 300 for j in range(16 + i % 16)] for i in range(args.prompts)]
        spec = SamplingSpec(n=args.n, max_new_tokens=args.tokens, seed=0)
        params = SamplingParams(n=args.n, max_tokens=args.tokens, temperature=1.0, seed=0,
                                logprobs=0)
        ours, bare = [], []
        engine.generate(prompts[:4], spec)  # warm-up
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate(prompts, spec)
            ours.append(sum(len(g.token_ids) for gs in out for g in gs) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            raw = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                      use_tqdm=False)
            bare.append(sum(len(c.token_ids) for o in raw for c in o.outputs)
                        / (time.perf_counter() - t0))
        engine.shutdown()
    o, b = summarize(ours), summarize(bare)
    print(table(["path", "tokens/s (median)", "min", "max"],
                [["wrapper", o["median"], o["min"], o["max"]],
                 ["bare vLLM", b["median"], b["min"], b["max"]]]))
    print(f"wrapper / bare: {o['median'] / b['median']:.3f}")
    write_json(args.out, {"args": vars(args), "wrapper_tok_s": o, "bare_tok_s": b,
                          "ratio": o["median"] / b["median"]})


if __name__ == "__main__":
    main()

"""Write a small dataset in verl's parquet layout, and a tiny model to train on it, for the
"Bring your dataset" example (docs/bring_your_dataset.md):

    python examples/verl_layout/make_data.py            # into runs/verl_example/
    python -m mugrpo_megatron train --config examples/verl_layout/cpu.yaml

Two training files of chat-message prompts (a mixture of two sources, one named by a
``data_source`` column, one by its file's stem), each row's gold answer in
``reward_model.ground_truth`` and its metadata in ``extra_info``; two held-out sets in the same
layout. Arithmetic problems from the builtin generator stand in for math (no download)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mugrpo_megatron.data.arithmetic import arithmetic_rows
from mugrpo_megatron.models.tiny import make_tiny_checkpoint


def verl_rows(problems: list[dict], source: str | None, unit: str) -> list[dict]:
    """Rows as verl's preprocessing scripts write them (DAPO-Math-17k's columns)."""
    out = []
    for i, p in enumerate(problems):
        row = {"prompt": [{"role": "user", "content": f"{p['question']} Give the answer in "
                                                      f"{unit}, within \\boxed{{}}."}],
               "ability": "MATH", "reward_model": {"ground_truth": p["answer"], "style": "rule"},
               "extra_info": {"index": i, "unit": unit}}
        if source is not None:
            row["data_source"] = source
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="runs/verl_example")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = arithmetic_rows(700, max_operand=20, seed=0)
    tables = {"train_a.parquet": verl_rows(problems[:400], "arith_apples", "apples"),
              "train_b.parquet": verl_rows(problems[400:600], None, "pears"),
              "heldout_a.parquet": verl_rows(problems[600:650], "arith_apples", "apples"),
              "heldout_b.parquet": verl_rows(problems[650:], None, "pears")}
    for name, rows in tables.items():
        pq.write_table(pa.Table.from_pylist(rows), out / name)
    if not (out / "model" / "config.json").exists():
        make_tiny_checkpoint(out / "model", "llama", seed=5)
    print(f"wrote {', '.join(tables)} and a tiny model into {out}")


if __name__ == "__main__":
    main()

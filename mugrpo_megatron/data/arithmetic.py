"""A seeded offline arithmetic task, so the demo and the tests need no download."""

from __future__ import annotations

import random

_OPS = (("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b))


def arithmetic_rows(num: int, *, max_operand: int, seed: int,
                    exclude: frozenset[str] = frozenset()) -> list[dict[str, str]]:
    """``num`` distinct problems ``{"question", "answer"}`` with two or three operands.

    Deterministic in ``seed``. Problems whose question is in ``exclude`` are not generated, so a
    held-out set can be drawn disjoint from the training set.
    """
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict[str, str]] = []
    attempts = 0
    while len(rows) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"cannot generate {num} distinct problems with operands up to "
                             f"{max_operand}; raise data.arithmetic_max_operand")
        n_terms = rng.choice((2, 2, 3))
        values = [rng.randint(0, max_operand) for _ in range(n_terms)]
        ops = [rng.choice(_OPS) for _ in range(n_terms - 1)]
        expr = str(values[0])
        for (sym, _), v in zip(ops, values[1:]):
            expr += f" {sym} {v}"
        question = f"What is {expr}?"
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": str(_evaluate(values, ops))})
    return rows


def _evaluate(values: list[int], ops: list) -> int:
    # usual precedence: multiplication first
    terms, signs = [values[0]], []
    for (sym, fn), v in zip(ops, values[1:]):
        if sym == "*":
            terms[-1] = fn(terms[-1], v)
        else:
            terms.append(v)
            signs.append(sym)
    total = terms[0]
    for sym, t in zip(signs, terms[1:]):
        total = total + t if sym == "+" else total - t
    return total

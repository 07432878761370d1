"""The math reward: an explicit answer anchor, checked against the gold answer by math-verify.

Only an explicit anchor counts: the last ``\\boxed{...}`` (or ``\\fbox{...}``) in the completion, or
else the text after the last ``####``. There is no last-number fallback, since a policy learns to
end every response with many numbers. The anchor is found by one linear scan and capped in length
before math-verify sees it, so parsing cost is bounded by the answer, not by the completion.
math-verify's own timeouts are set below the scorer's hard limit; the hard limit is the backstop.
"""

from __future__ import annotations

import re

from math_verify import LatexExtractionConfig, parse, verify

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_PARSE_TIMEOUT_S = 3  # math-verify requires ints here (a float silently fails every check)


# A box command with its opening brace, or any other brace: the tokens of extract_answer's scan.
_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")


def extract_answer(completion: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (the one that opens last; an unclosed box
    is skipped for the complete one before it), else the rest of the line after the last ``####``.

    One left-to-right pass over the braces with a stack of the open ones: linear in the length of
    the completion, whatever it holds (50,000 unclosed boxes take milliseconds)."""
    best: tuple[int, int] | None = None  # (content start, content end) of the last complete box
    open_braces: list[int] = []  # content start of each open brace; negative for a plain brace
    for m in _TOKENS.finditer(completion):
        token = m.group()
        if token == "}":
            if open_braces:
                start = open_braces.pop()
                if start >= 0 and (best is None or start > best[0]):
                    best = (start, m.start())
        elif token == "{":
            open_braces.append(-1)
        else:
            open_braces.append(m.end())
    if best is not None:
        return completion[best[0]:best[1]].strip()
    hashes = completion.rfind("####")
    if hashes >= 0:
        line = completion[hashes + 4:].split("\n", 1)[0].strip()
        return line or None
    return None


def _as_latex(answer: str) -> str:
    if "$" in answer or any(cmd in answer for cmd in _BOX_COMMANDS):
        return answer
    return f"${answer}$"


def math_reward(completion: str, answer: str, max_answer_chars: int = 1000) -> float:
    """1.0 if the completion's anchored answer equals the gold answer mathematically, else 0.0."""
    predicted = extract_answer(completion)
    if not predicted or len(predicted) > max_answer_chars:
        return 0.0
    gold = parse(_as_latex(answer), parsing_timeout=_PARSE_TIMEOUT_S)
    if not gold:
        raise ValueError(f"gold answer {answer[:100]!r} could not be parsed")
    pred = parse(f"\\boxed{{{predicted}}}",
                 extraction_config=[LatexExtractionConfig(boxed_match_priority=0,
                                                          try_extract_without_anchor=False)],
                 parsing_timeout=_PARSE_TIMEOUT_S)
    if not pred:
        return 0.0
    # gold first: math-verify's verify() is not symmetric
    return 1.0 if verify(gold, pred, timeout_seconds=_PARSE_TIMEOUT_S) else 0.0




_ANSWER_LINE = re.compile(r"(?im)^\s*answer\s*:\s*(.+?)\s*$")


def dapo_math_reward(completion: str, answer: str, max_answer_chars: int = 1000) -> float:
    """DAPO-Math's answer format (DAPO-Math-17k's prompts ask for it: "The last line of your
    response should be of the form Answer: $Answer"): the last ``Answer: ...`` line, else a
    ``\\boxed{}``, checked by math-verify as ``math_reward`` does. 1.0 or 0.0 (verl's
    ``math_dapo.compute_score`` gives +1 / -1 and compares normalised strings; with std-normalised
    advantages the two scales train alike)."""
    lines = _ANSWER_LINE.findall(completion)
    if lines:
        return math_reward(f"\\boxed{{{lines[-1].strip().strip('$')}}}", answer, max_answer_chars)
    return math_reward(completion, answer, max_answer_chars)

"""Prompt loading: formats, chat template, bad rows (error names file and row, or skip and count)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mugrpo_megatron.config import DataConfig
from mugrpo_megatron.data import gold_answer, load_prompts
from mugrpo_megatron.data.arithmetic import arithmetic_rows
from mugrpo_megatron.rewards.math_answer import math_reward

FIXTURES = Path(__file__).parent / "fixtures"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_arithmetic_is_seeded_correct_and_held_out_disjoint(tokenizer):
    a = arithmetic_rows(200, max_operand=30, seed=3)
    assert a == arithmetic_rows(200, max_operand=30, seed=3)
    assert a != arithmetic_rows(200, max_operand=30, seed=4)
    for row in a:
        expr = row["question"].removeprefix("What is ").removesuffix("?")
        assert int(row["answer"]) == eval(expr)  # noqa: S307 - our own generated arithmetic
    cfg = DataConfig(num_arithmetic_problems=300, eval_path="builtin:arithmetic", eval_size=40)
    train, report = load_prompts(cfg, tokenizer)
    held, _ = load_prompts(cfg, tokenizer, held_out=True)
    assert len(train) == 300 and report.num_kept == 300 and len(held) == 40
    assert not {p.text for p in train} & {p.text for p in held}
    with pytest.raises(ValueError, match="cannot generate 500 distinct problems"):
        arithmetic_rows(500, max_operand=2, seed=0)


def test_chat_template_and_instruction(tokenizer):
    cfg = DataConfig(num_arithmetic_problems=5, system_prompt="Be brief.")
    prompts, _ = load_prompts(cfg, tokenizer)
    text = tokenizer.decode(list(prompts[0].token_ids))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is")
    assert text.endswith("Put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    raw, _ = load_prompts(DataConfig(num_arithmetic_problems=5, chat_template=False, instruction=""),
                          tokenizer)
    assert tokenizer.decode(list(raw[0].token_ids)) == raw[0].text


def test_fixture_files_load_with_field_names(tokenizer):
    gsm, _ = load_prompts(DataConfig(path=str(FIXTURES / "gsm8k_exemplars.jsonl")), tokenizer)
    math, _ = load_prompts(DataConfig(path=str(FIXTURES / "math_problems.jsonl"),
                                      prompt_field="problem"), tokenizer)
    assert len(gsm) == 8 and len(math) == 11
    assert gsm[0].answer == "6" and math[2].answer == "\\frac{25}{13}"
    assert math_reward("\\boxed{25/13}", math[2].answer) == 1.0


def test_parquet(tmp_path, tokenizer):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["What is 1 + 1?", "What is 2 * 3?"], "a": ["2", "6"]}), path)
    prompts, _ = load_prompts(DataConfig(path=str(path), prompt_field="q", answer_field="a"), tokenizer)
    assert [p.answer for p in prompts] == ["2", "6"]


BAD_ROWS = [
    ({"question": "What is 1?", "answer": "1"}, None),
    ({"answer": "2"}, "missing field 'question'"),
    ({"question": ["a", "list"], "answer": "3"},
     "field 'question', message 0: expected a {role, content} pair of strings, got 'a'"),
    ({"question": 3, "answer": "3"}, "field 'question' must be a string or a list of {role, "
                                     "content} messages, got int"),
    ({"question": "Q4", "answer": ""}, "field 'answer' is empty"),
    ({"question": "Q5"}, "missing field 'answer'"),
    ({"question": "Q6", "answer": [1, 2]},
     "field 'answer' must be a string, a number or a struct (JSON test cases), got list"),
    ({"question": "long " * 400, "answer": "7"}, "over data.max_prompt_tokens=64"),
    ({"question": "Q8", "answer": 8}, None),  # numbers are fine answers
]


@pytest.mark.parametrize("bad", range(1, 8))
def test_bad_row_error_names_file_and_row(tmp_path, tokenizer, bad):
    rows = [BAD_ROWS[0][0], BAD_ROWS[bad][0], BAD_ROWS[0][0]]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = DataConfig(path=path, max_prompt_tokens=64)
    with pytest.raises(ValueError) as e:
        load_prompts(cfg, tokenizer)
    msg = str(e.value)
    assert msg.startswith(f"{path}: row 1 (line 2): ") and BAD_ROWS[bad][1] in msg, msg
    assert "data.on_bad_row: skip" in msg


def test_a_struct_ground_truth_is_its_json(tmp_path, tokenizer):
    """verl's code sets may store the test cases as a struct (parquet) or an object (JSON): the
    answer is then that object as JSON, which the code reward parses (issue 53)."""
    import json

    from mugrpo_megatron.rewards.code import parse_cases

    cases = {"inputs": ["1 2\n"], "outputs": ["3\n"], "fn_name": None}
    path = tmp_path / "code.parquet"
    pq.write_table(pa.table({"q": ["Add two numbers."], "a": [cases]}), path)
    prompts, _ = load_prompts(DataConfig(path=str(path), prompt_field="q", answer_field="a"),
                              tokenizer)
    assert json.loads(prompts[0].answer) == cases
    assert parse_cases(prompts[0].answer).inputs == ["1 2\n"]


def test_bad_rows_skipped_and_counted(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [r for r, _ in BAD_ROWS])
    prompts, report = load_prompts(DataConfig(path=path, max_prompt_tokens=64, on_bad_row="skip"),
                                   tokenizer)
    assert [p.index for p in prompts] == [0, 8] and prompts[1].answer == "8"
    assert report.num_rows == 9 and report.num_kept == 2 and report.num_skipped == 7
    assert report.skipped == {"missing prompt": 1, "bad message": 1, "wrong type": 2,
                              "empty answer": 1, "missing answer": 1, "prompt too long": 1}
    assert "row 1 (line 2): missing field 'question'" in report.examples[0]
    assert "7 rows" not in report.summary() and "2/9 rows kept" in report.summary()


def test_file_level_errors(tmp_path, tokenizer):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": "2"\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: row 1 \(line 2\): invalid JSON"):
        load_prompts(DataConfig(path=str(broken)), tokenizer)
    with pytest.raises(ValueError, match=r"data\.path: file not found: .*nope\.jsonl"):
        load_prompts(DataConfig(path=str(tmp_path / "nope.jsonl")), tokenizer)
    path = write_jsonl(tmp_path / "t.jsonl", [{"problem": "x", "answer": "1"}])
    with pytest.raises(ValueError, match=r"no column 'question' \(data\.prompt_field\); columns are"):
        load_prompts(DataConfig(path=path), tokenizer)
    with pytest.raises(ValueError, match=r"data\.path: 'no-such/dataset' is neither a local file"):
        load_prompts(DataConfig(path="no-such/dataset"), tokenizer)
    only_bad = write_jsonl(tmp_path / "b.jsonl", [{"question": "", "answer": "1"}])
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompts(DataConfig(path=only_bad, on_bad_row="skip"), tokenizer)


def test_gold_answer():
    assert gold_answer("so 3 + 4 = 7.\n#### 7") == "7"
    assert gold_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"


def test_weak_messages_name_the_file_and_line(tmp_path, tokenizer):
    """Defects: non-UTF-8 data, an empty file, malformed JSON under on_bad_row=skip, line numbers
    after blank lines, NaN gold answers in parquet."""
    good = json.dumps({"question": "What is 1?", "answer": "1"})
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join([good.encode(), b"", b"\xff\xfe not utf-8", b"",
                                 b'{"question": "broken"', b"[1, 2]", good.encode(), b""]))
    with pytest.raises(ValueError, match=r"mixed\.jsonl: row 1 \(line 3\): not UTF-8 text"):
        load_prompts(DataConfig(path=str(path)), tokenizer)
    prompts, report = load_prompts(DataConfig(path=str(path), on_bad_row="skip"), tokenizer)
    assert len(prompts) == 2 and report.num_rows == 5
    assert report.skipped == {"not UTF-8": 1, "invalid JSON": 1, "not an object": 1}
    assert "row 2 (line 5): invalid JSON" in report.examples[1]
    assert "row 3 (line 6): expected a JSON object, got list" in report.examples[2]
    blank = tmp_path / "blank.jsonl"
    blank.write_text(f"\n\n{good}\n\n" + json.dumps({"question": "x", "answer": ""}) + "\n")
    with pytest.raises(ValueError, match=r"blank\.jsonl: row 1 \(line 5\): field 'answer' is empty"):
        load_prompts(DataConfig(path=str(blank)), tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"data\.path: .*empty\.jsonl is empty"):
        load_prompts(DataConfig(path=str(empty)), tokenizer)
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"data\.path: .*empty\.jsonl has no rows"):
        load_prompts(DataConfig(path=str(empty)), tokenizer)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"question": "caf\xe9", "answer": "1"}]')
    with pytest.raises(ValueError, match=r"cannot read .*latin\.json: not UTF-8 text at line 1"):
        load_prompts(DataConfig(path=str(latin)), tokenizer)
    nan = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"question": ["What is 1?", "What is 2?"], "answer": [1.0, float("nan")]}),
                   nan)
    with pytest.raises(ValueError, match=r"nan\.parquet: row 1: field 'answer' is nan"):
        load_prompts(DataConfig(path=str(nan)), tokenizer)

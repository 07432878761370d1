"""The training prompts as a columnar file (data.prompt_store): the same prompts and report as
load_prompts, across batch boundaries; a bad row leaves no file; the key moves with what the
token ids depend on and nothing else; a rank holds nothing per prompt; rank 0 tokenizes and every
rank reads, and rank 0's error reaches every rank."""

import json
import random
import tracemalloc
from pathlib import Path

import pytest
from helpers import gloo_world, spawn_ranks

from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.data import load_prompts
from mugrpo_megatron.data.prompt_store import (
    PromptSet,
    open_prompt_set,
    prompt_key,
    prompt_paths,
    write_prompt_file,
)


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def mixed_rows(n: int, seed: int = 0) -> list:
    """Good rows of varied lengths (some over the 64-token limit) and bad ones."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.05:
            rows.append({"answer": "1"})  # missing prompt
        elif kind < 0.08:
            rows.append("{not json")
        elif kind < 0.12:
            rows.append({"question": "long " * 200, "answer": "2"})  # over max_prompt_tokens
        else:
            rows.append({"question": f"What is {i} + {rng.randrange(99)}?" + " and" * rng.randrange(9),
                         "answer": str(i)})
    return rows


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    """A model directory as far as prompts go: the tokenizer's files."""
    path = tmp_path / "model"
    tokenizer.save_pretrained(str(path))
    return path


def config(model_dir, run_dir, data, *extra):
    return load_config(None, [f"model.path={model_dir}", f"logging.run_dir={run_dir}",
                              f"data.path={data}", "data.max_prompt_tokens=64", *extra])


def test_prompt_file_holds_what_load_prompts_gives(tmp_path, tokenizer, model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", mixed_rows(300))
    cfg = config(model_dir, tmp_path / "run", data, "data.on_bad_row=skip")
    expected, expected_report = load_prompts(cfg.data, tokenizer)
    path, done = prompt_paths(tmp_path / "run", prompt_key(cfg))
    report = write_prompt_file(cfg, tokenizer, path, done, chunk_rows=7, batch_rows=20)  # many batches
    assert report == expected_report and report.num_skipped > 0
    assert report.skipped.keys() == {"missing prompt", "invalid JSON", "prompt too long"}
    prompts = PromptSet(path)
    assert len(prompts) == len(expected) == report.num_kept
    assert list(prompts) == expected  # index, text, answer, token ids: every one
    assert prompts.report == expected_report
    picks = [0, 6, 7, 8, len(expected) - 1]
    view = prompts.ids_view(picks)
    assert [view[i] for i in range(len(picks))] == [list(expected[i].token_ids) for i in picks]
    assert view[1:3] == [list(expected[i].token_ids) for i in picks[1:3]]
    assert prompts[2:4] == expected[2:4]
    with pytest.raises(IndexError):
        prompts[len(expected)]
    prompts.close()


def test_a_bad_row_leaves_no_prompt_file(tmp_path, tokenizer, model_dir):
    rows = [{"question": "What is 1?", "answer": "1"}] * 20 + [{"question": "x", "answer": ""}]
    cfg = config(model_dir, tmp_path / "run", write_jsonl(tmp_path / "t.jsonl", rows))
    path, done = prompt_paths(tmp_path / "run", prompt_key(cfg))
    with pytest.raises(ValueError, match=r"t\.jsonl: row 20 \(line 21\): field 'answer' is empty"):
        write_prompt_file(cfg, tokenizer, path, done, chunk_rows=4, batch_rows=4)  # after 5 batches
    assert not (tmp_path / "run").exists()  # what it made for the file is gone too
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half")  # an earlier writer killed before its record: not a prompt file
    with pytest.raises(ValueError, match="not a complete prompt file"):
        PromptSet(path)


def test_the_key_moves_with_what_the_token_ids_depend_on(tmp_path, model_dir):
    data = tmp_path / "t.jsonl"
    write_jsonl(data, [{"question": "What is 1?", "answer": "1"}])
    base = prompt_key(config(model_dir, tmp_path / "run", data))
    same = [config(model_dir, tmp_path / "elsewhere", data, "parallel.tensor=2",
                   "algo.updates_per_phase=4", "data.eval_size=3", "logging.progress=false")]
    moved = [config(model_dir, tmp_path / "run", data, "data.instruction=Think."),
             config(model_dir, tmp_path / "run", data, "data.max_prompt_tokens=65"),
             config(model_dir, tmp_path / "run", data, "data.chat_template=false")]
    assert all(prompt_key(c) == base for c in same)
    assert all(prompt_key(c) != base for c in moved)
    write_jsonl(data, [{"question": "What is 2?", "answer": "2"}])  # the file's content
    assert prompt_key(config(model_dir, tmp_path / "run", data)) != base
    write_jsonl(data, [{"question": "What is 1?", "answer": "1"}])
    (model_dir / "tokenizer_config.json").write_text(
        (model_dir / "tokenizer_config.json").read_text().replace("<|im_end|>", "<|im_end|> "))
    assert prompt_key(config(model_dir, tmp_path / "run", data)) != base  # the tokenizer's files


def test_a_rank_holds_nothing_per_prompt(tmp_path, tokenizer, model_dir):
    """Opening a file of 24,000 prompts keeps a few hundred bytes a batch, not bytes a prompt
    (an offsets array alone would be 96 KB), and reading prompts keeps nothing."""
    rows = [{"question": f"What is {i} + {i % 7}?", "answer": str(i)} for i in range(24_000)]
    cfg = config(model_dir, tmp_path / "run", write_jsonl(tmp_path / "t.jsonl", rows))
    path, done = prompt_paths(tmp_path / "run", prompt_key(cfg))
    write_prompt_file(cfg, tokenizer, path, done, chunk_rows=1024, batch_rows=2048)
    import pyarrow as pa

    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    prompts = PromptSet(path)
    opened = tracemalloc.get_traced_memory()[0]
    got = [prompts[i] for i in range(0, 24_000, 7)]
    del got
    read = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert opened < 16_000, opened  # 12 batches
    assert read - opened < 4_000, (opened, read)
    assert pa.total_allocated_bytes() == arrow_before
    assert prompts[23_999].answer == "23999"
    prompts.close()


def _rank(rank: int, cfg_args: list[str], out: str) -> None:
    """One rank of a 2-rank gloo world calling open_prompt_set (a file rendezvous: no port to
    race for beside other tests)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from mugrpo_megatron.distributed import RemoteFailure

    gloo_world(rank, 2, out, minutes=5)
    cfg = load_config(None, cfg_args)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    notes: list[str] = []
    try:
        prompts = open_prompt_set(cfg, Path(cfg.logging.run_dir), tok, note=notes.append)
        result = {"prompts": [[p.index, list(p.token_ids)] for p in prompts], "notes": notes,
                  "path": str(prompts.path)}
    except (ValueError, RemoteFailure) as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _two_ranks(cfg_args: list[str], out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    assert spawn_ranks(_rank, cfg_args, str(out)) == [0, 0]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_rank0_tokenizes_every_rank_reads_and_errors_reach_every_rank(tmp_path, tokenizer,
                                                                         model_dir):
    rows = [{"question": f"What is {i}?", "answer": str(i)} for i in range(50)]
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    args = [f"model.path={model_dir}", f"logging.run_dir={tmp_path / 'run'}", f"data.path={data}"]
    first = _two_ranks(args, tmp_path / "first")
    assert first[0]["prompts"] == first[1]["prompts"]
    assert [i for i, _ in first[0]["prompts"]] == list(range(50))
    expected, _ = load_prompts(load_config(None, args).data, tokenizer)
    assert first[0]["prompts"] == [[p.index, list(p.token_ids)] for p in expected]
    again = _two_ranks(args, tmp_path / "again")  # a resume: the file is reused, not rebuilt
    assert again[0]["prompts"] == first[0]["prompts"] and again[0]["path"] == first[0]["path"]
    assert any("reusing" in n for n in again[0]["notes"])
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:30] + ["[1]"] + rows[30:])
    failed = _two_ranks([*args[:2], f"data.path={bad}"], tmp_path / "bad")
    assert failed[0]["error"].startswith("ValueError: ") and "bad.jsonl: row 30 (line 31)" in \
        failed[0]["error"]
    assert failed[1]["error"].startswith("RemoteFailure: rank 0 failed: ValueError: ")
    assert "bad.jsonl: row 30 (line 31): expected a JSON object" in failed[1]["error"]

"""A user's data, reward and evaluation settings, unit by unit: chat-message prompts and dotted
fields, template options, sources and metadata, the mixture's shares over a long draw, reward
signatures and routing, the unbiased pass@k against enumeration over subsets; and every bad input
named (file, row, field or key) before any process group, with nothing written."""

import itertools
import json
import math
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from mugrpo_megatron.config import AlgoConfig, DataConfig, RewardConfig
from mugrpo_megatron.config.loader import load_config
from mugrpo_megatron.data import load_eval_sets, load_prompts
from mugrpo_megatron.evaluation import pass_at_k
from mugrpo_megatron.phase.schedule import PhaseScheduler
from mugrpo_megatron.rewards import RewardScorer, RewardSpec, RowInfo


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def verl_row(i: int, **extra) -> dict:
    return {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i}, **extra}


VERL = dict(prompt_field="prompt", answer_field="reward_model.ground_truth",
            metadata_fields=("extra_info",))


def test_message_prompts_dotted_fields_sources_and_metadata(tmp_path, tokenizer):
    rows = [verl_row(0, data_source="srcA"), verl_row(1)]
    rows[1]["prompt"] = [{"role": "system", "content": "Terse."},
                         {"role": "user", "content": "What is 1 + 1?"},
                         {"role": "assistant", "content": "Think first."},
                         {"role": "user", "content": "Go on."}]
    path = tmp_path / "mix_b.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = DataConfig(path=str(path), system_prompt="SYSTEM", instruction="BOX IT", **VERL)
    prompts, report = load_prompts(cfg, tokenizer)
    assert [p.answer for p in prompts] == ["1", "2"]
    assert [p.source for p in prompts] == ["srcA", "mix_b"]  # no data_source: the file's stem
    assert json.loads(prompts[0].metadata) == {"extra_info": {"index": 0}}
    # the system prompt only where the messages have none; the instruction on the last user one
    assert prompts[0].text.startswith("<|im_start|>system\nSYSTEM<|im_end|>")
    assert "What is 0 + 1?\nBOX IT<|im_end|>" in prompts[0].text
    assert prompts[1].text.count("SYSTEM") == 0 and "Terse." in prompts[1].text
    assert "Go on.\nBOX IT<|im_end|>\n<|im_start|>assistant\n" in prompts[1].text
    assert "Think first.<|im_end|>" in prompts[1].text  # not the last user message: as given
    assert list(prompts[0].token_ids) == tokenizer(prompts[0].text, add_special_tokens=False)[
        "input_ids"]
    plain, _ = load_prompts(DataConfig(path=write_jsonl(tmp_path / "p.jsonl", [
        {"question": "What is 2?", "answer": "2"}])), tokenizer)  # strings: as before
    assert plain[0].source == "p" and plain[0].metadata == ""
    assert plain[0].text.endswith("What is 2?\nPut your final answer within \\boxed{}.<|im_end|>\n"
                                  "<|im_start|>assistant\n")


def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    tokenizer.chat_template = ("{{ messages[-1]['content'] }}{% if enable_thinking is defined and "
                               "enable_thinking is false %} NOTHINK{% endif %}")
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "Q", "answer": "1"}])
    off, _ = load_prompts(DataConfig(path=path, instruction="",
                                     chat_template_kwargs={"enable_thinking": False}), tokenizer)
    on, _ = load_prompts(DataConfig(path=path, instruction=""), tokenizer)
    assert off[0].text == "Q NOTHINK" and on[0].text == "Q"
    cfg = load_config(None, [f"data.path={path}", "data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    from mugrpo_megatron.run_dir import fingerprint

    assert fingerprint(cfg)["data.chat_template_kwargs.enable_thinking"] is False


BAD = [
    (verl_row(0) | {"prompt": [{"role": "user", "content": 3}]},
     "field 'prompt', message 0: expected a {role, content} pair of strings"),
    (verl_row(0) | {"prompt": [{"role": "user", "text": "hi"}]},
     "field 'prompt', message 0: expected a {role, content} pair of strings"),
    (verl_row(0) | {"prompt": [{"role": "narrator", "content": "hi"}]},
     "field 'prompt', message 0: unknown role 'narrator'"),
    (verl_row(0) | {"prompt": [{"role": "system", "content": "hi"}]},
     "field 'prompt': no user message"),
    (verl_row(0) | {"reward_model": {"style": "rule"}},
     "missing field 'reward_model.ground_truth'"),
    ({k: v for k, v in verl_row(0).items() if k != "extra_info"},
     "missing field 'extra_info' (data.metadata_fields)"),
]


@pytest.mark.parametrize("bad", range(len(BAD)))
def test_a_bad_message_or_nested_field_names_file_row_and_field(tmp_path, tokenizer, bad):
    row, message = BAD[bad]
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(0), row, verl_row(2)])
    with pytest.raises(ValueError) as e:
        load_prompts(DataConfig(path=path, **VERL), tokenizer)
    assert str(e.value).startswith(f"{path}: row 1 (line 2): ") and message in str(e.value), e.value
    prompts, report = load_prompts(DataConfig(path=path, on_bad_row="skip", **VERL), tokenizer)
    assert [p.index for p in prompts] == [0, 2] and report.num_skipped == 1  # skip counts it


def test_messages_need_the_chat_template_and_no_column_is_a_column_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(0)])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): field 'prompt' holds chat messages, "
                                         r"which need the chat template"):
        load_prompts(DataConfig(path=path, chat_template=False, **VERL), tokenizer)
    with pytest.raises(ValueError, match=r"no column 'reward_model.truth' \(data.answer_field\)"):
        load_prompts(DataConfig(path=path, **{**VERL, "answer_field": "reward_model.truth"}),
                     tokenizer)


@pytest.mark.parametrize("sets, message", [
    (["data.path=[a.jsonl, b.jsonl]", "data.weights=[1]"],
     "data.weights: must have one number per data.path (2)"),
    (["data.path=[a.jsonl, b.jsonl]", "data.weights=[1, 0]"], "data.weights: must all be > 0"),
    (["data.path=[a.jsonl, b.jsonl]", "data.weights=[1, -2]"], "data.weights: must all be > 0"),
    (["data.path=[a.jsonl, b.jsonl]", "data.weights=[1, 1e-6]"], "at least 1/4096 of the draws"),
    (["data.weights=[1, 2]"], "data.weights: must have one number per data.path (1)"),
    (["data.metadata_fields=extra_info"], "data.metadata_fields: must be a list"),
    (["eval.pass_k=[8]", "data.eval_path=e.jsonl"], "eval.pass_k: 8 is more than any held-out"),
    (["eval.samples_by_set={aime: 4}", "data.eval_path=e.jsonl"],
     "eval.samples_by_set.aime: no held-out set of that name"),
    (["rollout.eval_samples=4"], "rollout.eval_samples: replaced by eval.samples"),
])
def test_bad_settings_are_named(sets, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config(None, sets)


def test_named_held_out_sets(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "math500.jsonl", [{"question": f"Q{i}", "answer": str(i)}
                                                  for i in range(5)])
    b = write_jsonl(tmp_path / "aime.jsonl", [{"question": "Q", "answer": "1"}])
    by_list = load_eval_sets(DataConfig(eval_path=(a, b), eval_size=3), tokenizer)
    assert {k: len(v[0]) for k, v in by_list.items()} == {"math500": 3, "aime": 1}
    by_map = load_eval_sets(DataConfig(eval_path={"M": a}, eval_size=10), tokenizer)
    assert list(by_map) == ["M"] and len(by_map["M"][0]) == 5
    twice = DataConfig(eval_path=(a, a)).eval_sets
    assert list(twice) == ["math500_0", "math500_1"]


def test_pass_at_k_is_the_unbiased_estimator():
    """1 - C(n - c, k) / C(n, k) is the chance that k of the n samples, drawn without
    replacement, hold a correct one: counted here over every subset."""
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    assert pass_at_k(16, 1, 1) == pytest.approx(1 / 16)
    assert pass_at_k(1000, 3, 500) == pytest.approx(1 - math.comb(997, 500) / math.comb(1000, 500))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_the_mixture_s_shares_over_a_long_draw():
    """Weights 1 : 3 over files of 1,000 and 50 prompts: over 10^5 draws each file gets its
    share to within one prompt a block of 4,096, and each file's own prompts come in passes (a
    small file weighted high repeats, evenly); the default is today's one shuffle of all."""
    sched = PhaseScheduler(AlgoConfig(), 8, 1050, file_sizes=(1000, 50), weights=(1.0, 3.0))
    drawn = sched._prompts(0, 100_000)
    small = sum(i >= 1000 for i in drawn)
    assert abs(small - 75_000) <= 100_000 // 4096 + 1, small
    counts = Counter(drawn)
    assert max(counts[i] for i in range(1000, 1050)) - min(counts[i] for i in range(1000, 1050)) <= 1
    assert max(counts[i] for i in range(1000)) - min(counts[i] for i in range(1000)) <= 1
    assert drawn[40_000:40_010] == PhaseScheduler(AlgoConfig(), 8, 1050, file_sizes=(1000, 50),
                                                  weights=(1.0, 3.0))._prompts(40_000, 10)
    proportional = PhaseScheduler(AlgoConfig(), 8, 1050, file_sizes=(1000, 50))
    assert proportional._prompts(0, 1050) == PhaseScheduler(AlgoConfig(), 8, 1050)._prompts(0, 1050)


SHORT = ["algo.total_updates=4", "algo.updates_per_phase=1", "algo.prompts_per_phase=3",
         "algo.samples_per_update=8", "rollout.group_size=4"]


def test_a_run_too_short_for_its_weights_is_told_which_files_it_never_draws(capsys):
    """Defect: with data.weights [2, 1, 1] a run that drew 12 prompts drew none of the third
    file (so its reward route never ran), and nothing said so."""
    from mugrpo_megatron.__main__ import main
    from mugrpo_megatron.phase.schedule import Mixture, mixture_coverage, run_draws

    paths = ["data.path=[a.parquet, b.parquet, c.parquet]", "data.weights=[2, 1, 1]"]
    cfg = load_config(None, [*paths, *SHORT])
    sched = PhaseScheduler(cfg.algo, 4, 30, file_sizes=(10, 10, 10), weights=(2, 1, 1))
    assert run_draws(cfg.algo, 4) == 12 == sum(p.num_prompts for p in sched.phases())
    drawn = sched._prompts(0, 12)
    got = [sum(10 * f <= i < 10 * (f + 1) for i in drawn) for f in range(3)]
    assert got == Mixture([1] * 3, (2, 1, 1), cfg.algo.seed).draws(12) == [7, 5, 0]
    for n in (4096, 4097, 10_000):  # the draws' count per file is the stream's, at any length
        m = PhaseScheduler(cfg.algo, 4, 30, file_sizes=(10, 10, 10), weights=(2, 1, 1)).mixture
        stream = m.prompts(0, n)
        assert m.draws(n) == [sum(10 * f <= i < 10 * (f + 1) for i in stream) for f in range(3)]
    text = mixture_coverage(cfg)
    assert "the run draws 12 prompts" in text and "shorter than one" in text
    assert "a 7 (weight's share 6.0), b 5 (weight's share 3.0), c 0 (weight's share 3.0)" in text
    assert "it never draws from data.path[2] (c.parquet)" in text
    # the sources the draws miss, from the prompt set (what train warns of at its start)
    sources = ["a"] * 10 + ["b"] * 10 + ["c"] * 10
    assert sched.unseen_sources(lambda idx: [sources[i] for i in idx], ["a", "b", "c"]) == ["c"]
    long = load_config(None, [*paths])  # 4 x 1024 prompts: the weights hold
    assert run_draws(long.algo, 8) == 4096 and mixture_coverage(long) == ""
    assert main(["plan", *[a for x in [*paths, *SHORT] for a in ("--set", x)]]) == 0
    assert "it never draws from data.path[2] (c.parquet)" in capsys.readouterr().out


def test_reward_signatures_and_routing():
    assert RewardSpec.of("tests.reward_helpers:row_reading_reward").takes == {"prompt", "metadata"}
    assert RewardSpec.of("math").takes == {"max_answer_chars"}
    with pytest.raises(ValueError, match="reward.name: 'tests.reward_helpers:needs_units' has a "
                                         "required parameter 'units' that the scorer cannot give"):
        RewardSpec.of("tests.reward_helpers:needs_units")
    with pytest.raises(ValueError, match=r"reward.by_source.b: cannot import 'nowhere:fn'"):
        RewardScorer(RewardConfig(by_source={"b": "nowhere:fn"}))
    cfg = RewardConfig(name="tests.reward_helpers:sleepy_reward", num_workers=1,
                       by_source={"mixB": "tests.reward_helpers:source_reward",
                                  "A": "tests.reward_helpers:row_reading_reward"})
    rows = [RowInfo("mixB"), RowInfo("other"),
            RowInfo("A", "x<think>\n\n</think>", json.dumps({"extra_info": {"scale": 0.5}}))]
    with RewardScorer(cfg) as scorer:
        out = scorer.score(["12", "12", "12"], ["12", "13", "x"], rows)
    # routed by source (0.25 a point), the default (exact match: 0), metadata and prompt read
    assert out.rewards == [0.25, 0.0, 0.5] and not out.num_errors, out


def test_a_bad_input_stops_train_before_any_process_group_and_writes_nothing(tmp_path, capsys):
    """A by_source key that no file yields, a bad row of a mixture's second file, a reward that
    needs what the scorer cannot give: ``train`` exits 2 naming it, no process group started,
    no run directory left."""
    from mugrpo_megatron.__main__ import main
    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=1)
    good = write_jsonl(tmp_path / "a.jsonl", [{"question": "Q", "answer": "1"}] * 3)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"question": "Q", "answer": "1"}, {"question": "Q"}])
    run = tmp_path / "run"
    base = ["--set", f"model.path={hf}", "--set", f"logging.run_dir={run}"]
    cases = [
        ([f"data.path=[{good}, {good}]", "reward.by_source={mathA: math}"],
         "reward.by_source.mathA: no prompt has that source; the data files' sources are ['a']"),
        ([f"data.path=[{good}, {bad}]"], f"{bad}: row 1 (line 2): missing field 'answer'"),
        ([f"data.path={good}", "reward.name=tests.reward_helpers:needs_units"],
         "required parameter 'units'"),
    ]
    for sets, message in cases:
        args = [a for s in sets for a in ("--set", s)]
        # the checks before a run read the data and the rewards as train does (defect: plan
        # and the dry run read neither, and passed a by_source key naming no source)
        for command in (["train"], ["train", "--dry-run"], ["plan"]):
            assert main([*command, *base, *args]) == 2, command
            assert message in capsys.readouterr().err, command
            assert not run.exists() and not dist.is_initialized()
            assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "hf"]
    assert main(["train", "--dry-run", *base, "--set", f"data.path={good}"]) == 0
    out = capsys.readouterr().out
    assert f"data.path: {good}: 3/3 rows kept; sources: a 3; its first 3 prompts rendered" in out
    assert f"logging.run_dir: {run}: a new run" in out and "fits: yes" in out


def test_an_empty_or_broken_parquet_file_is_named_with_no_line_ahead(tmp_path):
    """Defect: an empty parquet file was reported as 'not UTF-8 text at line 1 (byte 142)',
    after a line of HF datasets' own naming the file's absolute path."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), empty)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_DATASETS_OFFLINE="1")
    for path, message in [(empty, f"error: data.path: {empty} has no rows (a parquet file with "
                                  f"columns ['question', 'answer'] and no data)"),
                          (broken, f"error: data.path: {broken} is not a parquet file (")]:
        proc = subprocess.run([sys.executable, "-m", "mugrpo_megatron", "plan", "--set",
                               f"data.path={path}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2
        lines = [line for line in proc.stderr.splitlines() if str(path) in line]
        assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
        assert "UTF-8" not in proc.stderr

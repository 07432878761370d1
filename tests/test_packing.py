"""Packing sequences into rows: bins, the attention mask against attention on each sequence alone,
and unpacking back to per-sequence values."""

import pytest
import torch

from mugrpo_megatron.learner.packing import pack_row, plan_bins, sequence_lengths


def test_bins_hold_every_sequence_once_within_capacity():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (50,), generator=g).tolist()
    bins = plan_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(50))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # first-fit decreasing is within 11/9 OPT + 1 bins; the sum bound is the simple check
    assert len(bins) <= 11 / 9 * (sum(lengths) / 64 + 1) + 1


def test_a_sequence_longer_than_a_row_is_refused_by_name():
    with pytest.raises(ValueError, match=r"pack_tokens: sequence 1 takes 70 tokens"):
        plan_bins([10, 70], 64)


def test_rows_labels_positions_and_unpacking():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    p = pack_row(tokens, [3, 2, 5], capacity=12)
    assert p.tokens[0].tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 0, 0]
    assert p.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 0]
    # the next token never crosses into the next sequence
    assert p.labels[0].tolist() == [6, 7, 0, 9, 0, 2, 3, 4, 5, 0, 0, 0]
    assert p.cu_seqlens().tolist() == [0, 3, 5, 10, 12]
    # a full row has no padding tail: no sequence of length 0 (TE's THD attention expects the
    # offsets to rise strictly and end at the row's length)
    assert pack_row(tokens, [3, 2, 5], capacity=10).cu_seqlens().tolist() == [0, 3, 5, 10]
    # next-aligned values come back per sequence, 0 where the sequence has no next token
    assert p.unpack_values(p.labels).tolist() == [[6, 7, 0, 0, 0], [9, 0, 0, 0, 0], [2, 3, 4, 5, 0]]


def test_masked_attention_on_a_packed_row_equals_each_sequence_alone():
    g = torch.Generator().manual_seed(1)
    d, lengths = 8, [4, 1, 6, 3]
    seqs = [torch.randn(n, d, generator=g) for n in lengths]
    wq, wk, wv = (torch.randn(d, d, generator=g) for _ in range(3))

    def attend(x, masked):  # masked: True where not allowed (megatron's convention)
        scores = (x @ wq) @ (x @ wk).T / d**0.5
        return torch.softmax(scores.masked_fill(masked, float("-inf")), -1) @ (x @ wv)

    alone = [attend(x, torch.ones(len(x), len(x), dtype=torch.bool).triu(1)) for x in seqs]
    # pack the hidden states the way pack_row packs tokens (feature rows instead of ids)
    p = pack_row(torch.zeros(len(lengths), max(lengths), dtype=torch.long), lengths, capacity=16)
    row = torch.zeros(16, d)
    row[:sum(lengths)] = torch.cat(seqs)
    out = attend(row, p.attention_mask()[0, 0])
    for i, ref in enumerate(alone):
        got = out[p.unpack[i, :lengths[i]]]
        assert torch.allclose(got, ref, atol=1e-6), i


def test_sequence_lengths_end_at_the_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert sequence_lengths(mask) == [3, 5, 5]


def test_thd_parameters_meet_transformer_engine_and_megatron_rules():
    """What a packed row hands TE's THD attention and megatron's RoPE, for rows planned as the
    learner plans them (first fit at capacities that are multiples of FP8 x TP) and the filler
    row of expert parallelism. TE (DotProductAttention.forward, 2.0-2.20): cu_seqlens int32,
    one dimension, from 0 to the row's length (the tokens it is given), rising strictly (a
    zero-length sequence breaks cuDNN's ragged offsets). megatron-core (0.16.1): max_seqlen at
    least every segment (its RoPE table and TE's kernels are sized by it), and below the row's
    length when a row holds two segments, else its unfused THD RoPE places each sequence at its
    offset in the row (positions would not restart at 0 as position_ids say they do)."""
    from mugrpo_megatron.learner.microbatch import filler

    g = torch.Generator().manual_seed(2)
    for capacity in (16, 128, 512, 4096):
        lengths = torch.randint(1, capacity + 1, (60,), generator=g).tolist()
        lengths[:3] = [capacity, capacity // 2, capacity - capacity // 2]  # exactly full rows
        for members in plan_bins(lengths, capacity):
            lens = [lengths[i] for i in members]
            row = pack_row(torch.ones(len(lens), max(lens), dtype=torch.long), lens, capacity)
            cu = row.cu_seqlens()
            assert cu.dtype == torch.int32 and cu.dim() == 1
            assert cu[0] == 0 and cu[-1] == row.tokens.shape[1] == capacity
            segments = cu.diff()
            assert (segments > 0).all(), cu
            assert row.max_seqlen >= int(segments.max())
            if len(segments) > 1:
                assert row.max_seqlen < capacity
            for start, n in zip(cu[:-1].tolist(), lens):  # each sequence starts at position 0
                assert row.position_ids[0, start:start + n].tolist() == list(range(n))
    empty = filler(128, train=True).packed
    assert empty.cu_seqlens().tolist() == [0, 128] and empty.max_seqlen == 128

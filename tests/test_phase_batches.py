"""Rollout rows: batches for the learner, the log-prob gap, replica shares, engine sleep."""

from dataclasses import replace

from helpers import Sample, to_batch

from mugrpo_megatron.phase.batches import logprob_gap


def samples():
    out = []
    for group, rewards in enumerate([(1.0, 0.0), (1.0, 1.0)]):
        for j, r in enumerate(rewards):
            out.append(Sample(phase=2, prompt_index=10 + group, group=group,
                              prompt_ids=(5, 6, 7)[: 2 + group], response_ids=(8, 9, 10)[: 1 + j],
                              behav_logprobs=(-0.5, -1.5, -2.5)[: 1 + j], finish_reason="stop",
                              reward=r))
    return out


def test_to_batch_layout():
    rows = [replace(x, advantage=a) for x, a in zip(samples(), (0.7, -0.7, 0.0, 0.0))]
    b = to_batch(rows, pad_id=0, multiple_of=4)
    assert b.tokens.shape == (4, 8)  # longest row 3 + 2 = 5, rounded up to 8
    assert b.tokens[1].tolist() == [5, 6, 8, 9, 0, 0, 0, 0]
    assert b.response_mask[1].tolist() == [False, False, True, True] + [False] * 4
    assert b.behav_logp[1, 2:4].tolist() == [-0.5, -1.5]
    assert b.advantages.tolist()[2:] == [0.0, 0.0]  # uniform group
    assert b.advantages[0] > 0 > b.advantages[1]


def test_gap():
    b = to_batch(samples())
    gap = logprob_gap(b.behav_logp + 0.25 * b.response_mask, b)
    assert gap.mean == gap.max == 0.25 and gap.num_tokens == int(b.response_mask.sum())


def test_replica_shares_cover_prompts_in_order():
    from mugrpo_megatron.engines.fleet import share

    for n, r in [(10, 3), (8, 4), (2, 4), (0, 2), (64, 1)]:
        s = [share(n, k, r) for k in range(r)]
        assert s[0].start == 0 and s[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(s, s[1:]))  # contiguous, in prompt order
        sizes = [x.stop - x.start for x in s]
        assert max(sizes) - min(sizes) <= 1, (n, r, sizes)


def test_sleep_then_wake_weights_first_resumes_each_type_once():
    """The trainer wakes the weights alone for the sync, then the rest after offloading the
    learner; engines refuse to resume a memory type twice."""
    from mugrpo_megatron.engines.base import RolloutEngine

    class Recorder(RolloutEngine):  # the bookkeeping of the base class, not an engine
        supports_sleep = True

        def __init__(self):
            self.calls = []

        def _release_memory(self):
            self.calls.append("release")
            return {"weights", "kv_cache", "cuda_graph"}

        def _resume_memory(self, tags):
            self.calls.append(tuple(tags))

        generate = update_weights = shutdown = None

    e = Recorder()
    e.sleep()
    e.sleep()  # already asleep: nothing more to release
    e.wake(weights_only=True)
    e.wake(weights_only=True)
    e.wake()
    e.wake()
    assert e.calls == ["release", ("weights",), ("cuda_graph", "kv_cache")]
    e.sleep()
    e.wake()
    assert e.calls[-2:] == ["release", ("cuda_graph", "kv_cache", "weights")]

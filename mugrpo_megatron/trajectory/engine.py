"""Trajectories: a rollout engine whose samples are model turns and the tool messages between
them (``rollout.tools``), for every caller of an engine (a phase's streaming generation, held-out
evaluation) through the same ``RolloutEngine`` contract.

One sample, from its prompt: a model turn (at most the tokens left of ``rollout.max_new_tokens``,
which counts every token after the prompt, tool messages included, so a sequence is never longer
than prompt + ``max_new_tokens``, as without tools); the calls parsed from it (``calls``); each
call run by the tool pool (``tools``) while the engine goes on decoding the other sequences; the
results rendered as the chat template's tool messages plus the next generation prompt
(``render``) and appended as tokens; the next turn. It ends at a turn without a call ('stop'), a
turn cut at the budget, or tool messages that would leave no token for a next turn ('length'),
or after ``rollout.max_turns`` model turns ('turns'). So it always starts and ends with model
tokens, and its tool messages are spans the loss leaves out.

The loop, per replica: the engine's scheduler steps (``RolloutEngine.step_turns``: one vLLM step;
SGLang a batch of every waiting turn); each finished turn either ends its sample or starts its
calls; the calls that finished since are collected and their samples' next turns queued. The
engine waits on a tool only when it has nothing else to run. Where a replica spans several ranks
(vLLM spmd, TP > 1), every rank runs this loop on the same outputs; only the replica's leader
runs the tools, and the finished calls of each step are broadcast to its other ranks
(``agree``: one small broadcast inside the replica a step while any call is pending, none
otherwise), so that every rank's scheduler is given the same requests in the same order.

Seeds: turn t > 0 of sample j of the prompt at phase position p samples with a seed derived from
(the sample's own seed, t) (``turn_seed``): a resumed phase regenerates the same trajectories
where the tools answer the same.
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from mugrpo_megatron.engines.base import RolloutEngine, TurnRequest, WeightSyncStats
from mugrpo_megatron.trajectory.calls import ToolCall, capped, parse_calls
from mugrpo_megatron.trajectory.render import TurnRenderer
from mugrpo_megatron.trajectory.tools import ToolPool, ToolResult
from mugrpo_megatron.types import Generation, SamplingSpec


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of a sample's ``turn`` (0: the sample's own seed)."""
    if seed is None or turn == 0:
        return seed
    return (seed * 6364136223846793005 + turn * 1442695040888963407) % 2**63


@dataclass
class _Sample:
    """A trajectory being built."""

    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    finish: str = ""
    pending: list[tuple[ToolCall, concurrent.futures.Future | None]] = field(default_factory=list)

    def generation(self) -> Generation:
        return Generation(tuple(self.tokens), tuple(self.logprobs), self.finish,
                          tuple(self.spans), self.turns, self.calls, self.errors)


class ToolEngine(RolloutEngine):
    """An engine (``inner``) whose samples are trajectories; weights, sleep and shutdown are the
    inner engine's. ``tools`` is None on a replica rank that is not its leader (it takes the
    leader's results through ``agree``)."""

    streams = True
    takes_rows = True

    def __init__(self, inner: RolloutEngine, renderer: TurnRenderer, tools: ToolPool | None,
                 *, call_format: str, max_turns: int, max_calls: int = 4,
                 agree: Callable[[object], object] | None = None):
        self.inner = inner
        self.renderer = renderer
        self.tools = tools
        self.call_format = call_format
        self.max_turns = max_turns
        self.max_calls = max_calls
        """Calls of a turn that run (``rollout.max_tool_calls_per_turn``)."""
        self._unknown: set[str] = set()
        """Tools named by rows' settings but not run here, each warned of once."""
        self._unanswered_said = False
        """Whether a trajectory ended with calls unanswered for the budget was warned of."""
        self.agree = agree
        """The replica leader's value on every rank of its replica (None: a one-rank replica)."""
        self.supports_sleep = inner.supports_sleep
        self.sleep_discards_weights = inner.sleep_discards_weights
        self.max_running_sequences = inner.max_running_sequences
        self.weight_format = inner.weight_format

    # the inner engine's contract, unchanged
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        return self.inner.update_weights(weights)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self, weights_only: bool = False) -> None:
        self.inner.wake(weights_only=weights_only)

    def shutdown(self) -> None:
        if self.tools is not None:
            self.tools.close()
        self.inner.shutdown()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                 rows: Callable[[int], dict] | None = None) -> list[list[Generation]]:
        out: list[list[Generation]] = [[] for _ in prompts]
        for i, group in self.generate_stream(prompts, sampling, list(range(len(prompts))),
                                             rows=rows):
            out[i] = group
        return out

    def generate_stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec,
                        positions: Sequence[int], max_in_flight: int = 0,
                        rows: Callable[[int], dict] | None = None
                        ) -> Iterator[tuple[int, list[Generation]]]:
        """The module docstring's loop over ``prompts`` (``max_in_flight`` of them at once),
        yielding each prompt's G trajectories when its last one ends. ``rows(i)``: prompt
        ``i``'s tool settings (``trajectory.tool_rows``), given to the tools that take them."""
        g = sampling.n
        turn = replace(sampling, n=1)
        window = max_in_flight or len(prompts)
        waiting = iter(range(len(prompts)))
        samples: dict[int, _Sample] = {}  # key i * G + j
        left: dict[int, int] = {}  # open prompt -> its samples still running
        running = 0  # turns in the engine
        tooling: list[int] = []  # samples waiting on their calls, in the order they made them

        def queue(keys: list[int]) -> None:
            nonlocal running
            requests = []
            for key in keys:
                s = samples[key]
                prefix = list(prompts[key // g]) + s.tokens
                requests.append(TurnRequest(key, prefix, sampling.max_new_tokens - len(s.tokens),
                                            turn_seed(s.seed, s.turns)))
            if requests:
                self.inner.submit_turns(requests, turn)
                running += len(requests)

        def end(key: int, why: str) -> None:
            samples[key].finish = why
            left[key // g] -= 1

        try:
            while True:
                fresh = []
                while len(left) < window and (i := next(waiting, None)) is not None:
                    left[i] = g
                    base = sampling.seed_at(positions[i])
                    for j in range(g):
                        samples[i * g + j] = _Sample(None if base is None else base + j)
                        fresh.append(i * g + j)
                queue(fresh)
                if not left:
                    return
                finished = self.inner.step_turns() if running else []
                running -= len(finished)
                for key, gen in finished:
                    row = rows(key // g) if rows is not None and self.tools is not None else None
                    if row:
                        self._check_row(row, positions[key // g])
                    if self._took_turn(samples[key], gen, sampling.max_new_tokens, row):
                        tooling.append(key)
                    else:
                        end(key, samples[key].finish)
                ready = self._ready(tooling, samples, wait=not running)
                tooling = [k for k in tooling if k not in ready]
                nxt = []
                for key in ready:  # in the order they called
                    s = samples[key]
                    if self._took_results(s, ready[key], sampling.max_new_tokens):
                        nxt.append(key)
                    else:
                        end(key, "length")
                queue(nxt)
                for i in [i for i, n in left.items() if n == 0]:
                    del left[i]
                    yield i, [samples.pop(i * g + j).generation() for j in range(g)]
        finally:
            self.inner.abort_turns()

    def _check_row(self, row: dict, position: int) -> None:
        """Warn, once a tool name, where a row's settings name a tool the run does not have
        (their settings would go nowhere, silently)."""
        for name in sorted(set(row) - set(self.tools.tools)) if self.tools is not None else ():
            if name not in self._unknown:
                self._unknown.add(name)
                print(f"warning: the tool settings of the prompt at position {position} "
                      f"(extra_info.tools_kwargs) name the tool {name!r}, which rollout.tools "
                      f"does not have ({', '.join(sorted(self.tools.tools))}): its settings "
                      f"reach no call", file=sys.stderr, flush=True)

    def _took_turn(self, s: _Sample, gen: Generation, budget: int, row: dict | None) -> bool:
        """Append a model turn; whether it called tools that will run (else ``s.finish`` says
        why it ended)."""
        s.tokens += gen.token_ids
        s.logprobs += gen.logprobs
        s.turns += 1
        if gen.finish_reason == "length" or len(s.tokens) >= budget:
            s.finish = "length"
            return False
        text = self.renderer.tokenizer.decode(list(gen.token_ids), skip_special_tokens=False)
        calls = parse_calls(text, self.call_format)
        s.calls += len(calls)
        if not calls:
            s.finish = "stop"
            return False
        if s.turns >= self.max_turns:
            s.finish = "turns"
            return False
        calls, over = capped(calls, self.max_calls)
        s.errors += max(0, over - 1)  # each call not run counts failed; one message says so
        s.pending = [(c, self.tools.submit(c, row) if self.tools is not None else None)
                     for c in calls]
        return True

    def _took_results(self, s: _Sample, results: list[tuple[str, str, bool]],
                      budget: int) -> bool:
        """Append a turn's tool messages; whether a next turn has room. Where the messages
        leave no token for a next turn, the trajectory ends with its calls unanswered: each
        counts as failed (the phase's tool_error_frac), and the first time it is said why."""
        s.errors += sum(failed for _, _, failed in results)
        s.pending = []
        ids = self.renderer.tool_ids([(name, text) for name, text, _ in results])
        if len(s.tokens) + len(ids) >= budget:
            s.errors += sum(not failed for _, _, failed in results)
            if not self._unanswered_said and self.tools is not None:
                self._unanswered_said = True
                print(f"warning: a trajectory's tool messages ({len(ids)} tokens) did not fit "
                      f"what was left of rollout.max_new_tokens = {budget} after its "
                      f"{len(s.tokens)} tokens: it ended ('length') with its calls unanswered, "
                      f"each counted as a failed call. Raise rollout.max_new_tokens or lower "
                      f"rollout.tool_output_chars if this is common", file=sys.stderr,
                      flush=True)
            return False
        s.spans += [len(s.tokens), len(s.tokens) + len(ids)]
        s.tokens += ids
        s.logprobs += [0.0] * len(ids)
        return True

    def _ready(self, tooling: list[int], samples: dict[int, _Sample], wait: bool
               ) -> dict[int, list[tuple[str, str, bool]]]:
        """The samples whose every call has finished, with their results, in the order they
        called (on the leader; the same on every rank of the replica). ``wait``: the engine has
        nothing to run, so wait for at least one. No call pending (``tooling`` is the same list
        on every rank of a replica: each runs this loop on the same outputs): nothing to agree
        on, so no broadcast, where there used to be one every engine step."""
        if not tooling:
            return {}
        ready: dict[int, list[tuple[str, str, bool]]] | None = None
        if self.tools is not None:
            def done(key: int) -> bool:
                return all(f.done() for _, f in samples[key].pending)

            if wait and tooling and not any(done(k) for k in tooling):
                concurrent.futures.wait([f for k in tooling for _, f in samples[k].pending],
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            ready = {}
            for key in tooling:
                if done(key):
                    results: list[ToolResult] = [self.tools.result(c, f)
                                                 for c, f in samples[key].pending]
                    ready[key] = [(r.name, r.text, r.failed) for r in results]
        if self.agree is not None:
            ready = self.agree(ready)
        return ready or {}

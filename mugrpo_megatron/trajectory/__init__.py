"""Multi-turn, tool-using rollouts (``rollout.tools``): a sample is a trajectory of model turns
and the tool messages between them.

- ``calls``: tool calls parsed from a model turn (Hermes, Llama 3.1 JSON);
- ``render``: a tool message's tokens from the chat template's rendering of it;
- ``tools``: the built-in python tool (the code reward's sandbox), users' tools, the pool of
  worker processes that runs calls while the engine decodes;
- ``engine``: ``ToolEngine``, a rollout engine whose samples are trajectories, for every caller
  of an engine (a phase's generation, held-out evaluation).

The trajectory's tool tokens are spans (``Generation.tool_spans``) that the shards keep and the
loss leaves out (``phase.batches.padded_batch``). ``ToolSetup`` is what the trainer hands the
engines. Light to import: the engine and the pool are imported where they are made.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolSetup:
    """What turns an engine into a ``ToolEngine``: the tokenizer and template options the
    prompts were rendered with, and the sandbox the python tool runs in (``reward.sandbox*``)."""

    tokenizer: Any
    template_kwargs: dict
    sandbox: Any
    """``rewards.sandbox_spec.SandboxSpec``."""

    @classmethod
    def of(cls, cfg, tokenizer) -> ToolSetup | None:
        """The run's setup, None without ``rollout.tools``."""
        if not cfg.rollout.tools:
            return None
        from mugrpo_megatron.rewards.sandbox_spec import SandboxSpec

        kwargs = {k: v for k, v in cfg.data.chat_template_kwargs.items() if k != "tools"}
        return cls(tokenizer, kwargs, SandboxSpec.of(cfg.reward))

    def wrap(self, engine, r, leader: bool, agree=None):
        """``engine`` as a ``ToolEngine`` for ``rollout`` settings ``r``; its tools run here
        where this rank leads its replica (``agree`` brings the leader's results to the
        replica's other ranks)."""
        from mugrpo_megatron.trajectory.calls import call_format
        from mugrpo_megatron.trajectory.engine import ToolEngine
        from mugrpo_megatron.trajectory.render import TurnRenderer
        from mugrpo_megatron.trajectory.tools import ToolPool, resolve_tools

        specs = resolve_tools(r.tools)
        renderer = TurnRenderer(self.tokenizer, [s.schema for s in specs], self.template_kwargs)
        pool = ToolPool(specs, self.sandbox, r.tool_workers, r.tool_timeout_s,
                        r.tool_output_chars) if leader else None
        if leader:
            for warning in tool_warnings(r, renderer):
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        fmt = call_format(getattr(self.tokenizer, "chat_template", None), r.tool_format)
        return ToolEngine(engine, renderer, pool, call_format=fmt, max_turns=r.max_turns,
                          max_calls=r.max_tool_calls_per_turn, agree=agree)


def tool_warnings(r, renderer) -> list[str]:
    """What in ``rollout`` settings ``r`` and the chat template (``renderer``'s) runs, but
    not as a user would expect: said at the start of ``train``, ``eval`` and in ``plan``."""
    out = []
    if not renderer.shows_tools():
        out.append("the chat template renders a prompt the same with the tools as without: the "
                   "model is never shown its tools (rollout.tools). Give the tokenizer a template "
                   "with a tool section (chat_template.jinja in model.path)")
    if r.max_turns == 1:
        out.append("rollout.max_turns is 1 with rollout.tools: a turn that calls a tool ends "
                   "its trajectory, so no call is ever answered; 2 or more lets the model read "
                   "its tools' answers")
    return out


def tool_rows(prompt) -> dict:
    """A prompt's per-row tool settings, verl's ``extra_info.tools_kwargs`` ({tool name:
    {"create_kwargs": ..., "execute_kwargs": ...}}), found in its metadata (``data.
    metadata_fields: [extra_info]``, or ``[extra_info.tools_kwargs]``); {} where it has none."""
    if not prompt.metadata:
        return {}
    meta = json.loads(prompt.metadata)
    found = meta.get("extra_info.tools_kwargs", meta.get("tools_kwargs"))
    if found is None and isinstance(meta.get("extra_info"), dict):
        found = meta["extra_info"].get("tools_kwargs")
    return found if isinstance(found, dict) else {}


def model_text(tokenizer, gen) -> str:
    """What the model wrote in a sample, its tool messages left out (what a reward reads: a
    tool's output is not the model's answer)."""
    ids, spans = list(gen.token_ids), list(gen.tool_spans)
    if not spans:
        return tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [0, *spans, len(ids)]
    return "".join(tokenizer.decode(ids[a:b], skip_special_tokens=True)
                   for a, b in zip(cuts[0::2], cuts[1::2]))

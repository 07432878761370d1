"""A tool message's tokens, from the chat template's own rendering of it.

A trajectory's token ids are those the engine saw and produced: the prompt, each model turn as
sampled (never decoded and tokenized again), and between turns the tool messages as the chat
template renders them after an assistant turn, followed by the template's generation prompt for
the next one. The template renders that piece here by difference: the conversation
``[user, assistant]`` (a placeholder in each) rendered with and without the tool messages after
it, the longer one starting with the shorter. What the template puts after an assistant's text
begins with the token that ends the turn (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``);
the model sampled its own stop token in its place, so that token is left out and the rest
(ChatML's newline, then the tool messages) is the tool piece.

Where this differs from rendering the whole conversation: templates that rewrite earlier turns
(Qwen3 drops the thinking of assistant turns before the last user message; some templates
re-serialise tool calls from ``tool_calls``) render a conversation the model never saw while
sampling. The trajectory keeps what it saw, as verl's and slime's token-in-token-out rollouts do.

A tool's output is text a program printed, not the template's: it is tokenized on its own with
special tokens split (a printed ``<|im_end|>\n<|im_start|>assistant`` stays text, never the
control tokens that would forge a turn), the envelope around it with the template's special
tokens recognised. The output is taken as the template renders it, as given (Qwen's, Hermes')
or escaped (Llama 3's ``tojson``): the turn rendered with a marker in each output's place gives
the envelope, and rendered with one output at a time, what stands at its marker's place.

Cost: a template rendering a tool message (~1 ms each; the envelope is rendered once a set of
tool names), one more for a turn of several, and a tokenization of each piece, a tool turn.
"""

from __future__ import annotations

from collections.abc import Sequence

_USER = "\u2063user\u2063"
_ASSISTANT = "\u2063assistant\u2063"
_PROBE = "  a probe\n<|im_end|> of \"text\"  "
"""Content a template must render in one piece (spaces at both ends, a newline, a quote, a
special token's text) for tool output to be placed and tokenized apart from the envelope."""


_ENVELOPES_KEPT = 256
"""Tool-name sets whose envelope is kept (a call's name is the model's, unknown ones too)."""


def _content_marker(i: int) -> str:
    return f"\u2063tool {i}\u2063"


class TurnRenderer:
    """Tool messages as token ids for one tokenizer and chat template (``tools`` the OpenAI
    function schemas given to the template as ``tools=``, ``template_kwargs`` its other options,
    e.g. ``enable_thinking``)."""

    def __init__(self, tokenizer, tools: Sequence[dict], template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.kwargs = dict(template_kwargs or {})
        self._specials = sorted({*getattr(tokenizer, "all_special_tokens", []),
                                 *getattr(tokenizer, "added_tokens_encoder", {})},
                                key=len, reverse=True)
        self._envelopes: dict[tuple[str, ...], tuple[str, list[str]]] = {}
        """``_envelope``'s, by the tools' names (a few: the names a turn calls)."""
        # a template that cannot render tool turns, or not their content in one piece: now
        self.tool_ids([("probe", _PROBE)])

    def shows_tools(self) -> bool:
        """Whether the template renders the tools at all: a prompt with them differs from one
        without (SmolLM2's template, for one, drops them without a word)."""
        if not self.tools:
            return True
        user = [{"role": "user", "content": _USER}]
        render = self.tokenizer.apply_chat_template
        return render(user, tools=self.tools, tokenize=False, add_generation_prompt=True,
                      **self.kwargs) != render(user, tokenize=False, add_generation_prompt=True,
                                               **self.kwargs)

    def tool_text(self, results: Sequence[tuple[str, str]]) -> str:
        """The text between a model turn that ended with its stop token and the next turn: what
        the template puts after an assistant's text, less its end-of-turn token (the model's
        stop token stands in for it), the tool messages ``results`` ((tool name, content) each),
        and the next turn's generation prompt."""
        conversation = [{"role": "user", "content": _USER},
                        {"role": "assistant", "content": _ASSISTANT},
                        *({"role": "tool", "name": name, "content": content}
                          for name, content in results)]
        full = self.tokenizer.apply_chat_template(
            conversation, tools=self.tools or None, tokenize=False, add_generation_prompt=True,
            **self.kwargs)
        at = full.rfind(_ASSISTANT)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content "
                             "before tool messages; tool turns need a template that does")
        after = full[at + len(_ASSISTANT):]
        end = next((s for s in self._specials if s and after.startswith(s)), "")
        return after[len(end):]

    def tool_ids(self, results: Sequence[tuple[str, str]]) -> list[int]:
        """``tool_text`` as token ids: the template's envelope with its special tokens, and each
        tool's output as the template renders it (as given, or escaped: Llama 3's templates write
        a tool's content through ``tojson``) tokenized apart with special tokens split (see the
        module docstring)."""
        markers = [_content_marker(i) for i in range(len(results))]
        framed, envelope = self._envelope(tuple(name for name, _ in results))
        pieces: list[tuple[str, bool]] = []  # (text, whether its special tokens are tokens)
        for i, (_, content) in enumerate(results):
            one = self.tool_text([(n, content if j == i else markers[j])
                                  for j, (n, _) in enumerate(results)])
            head = "".join(e + m for e, m in zip(envelope[:i], markers[:i])) + envelope[i]
            tail = framed[len(head) + len(markers[i]):]
            if not (one.startswith(head) and one.endswith(tail)) or len(one) < len(head) + len(tail):
                raise ValueError("the chat template renders the rest of a tool turn differently "
                                 "with each tool's output; tool turns need one that does not")
            pieces += [(envelope[i], True), (one[len(head):len(one) - len(tail)], False)]
        pieces.append((envelope[-1], True))
        if len(results) > 1 and "".join(t for t, _ in pieces) != self.tool_text(results):
            raise ValueError("the chat template renders a tool turn's outputs depending on each "
                             "other; tool turns need one that does not")
        return [i for text, specials in pieces for i in self._encode(text, specials)]

    def _envelope(self, names: tuple[str, ...]) -> tuple[str, list[str]]:
        """The tool turn of tools ``names`` rendered with a marker in each output's place, and
        the text around the markers. It depends on the names alone, so it is rendered once a
        set of names (a phase's 10^6 trajectories render one a tool turn otherwise)."""
        if names not in self._envelopes:
            if len(self._envelopes) >= _ENVELOPES_KEPT:  # names a model made up: start again
                self._envelopes.clear()
            markers = [_content_marker(i) for i in range(len(names))]
            framed = self.tool_text(list(zip(names, markers)))
            envelope, rest = [], framed
            for marker in markers:
                before, found, rest = rest.partition(marker)
                if not found:
                    raise ValueError("the chat template does not render a tool message's "
                                     "content (or not as one piece); tool turns need a "
                                     "template that does")
                envelope.append(before)
            envelope.append(rest)
            self._envelopes[names] = (framed, envelope)
        return self._envelopes[names]

    def _encode(self, text: str, specials: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=not specials)
                    ["input_ids"]) if text else []

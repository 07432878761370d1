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

Cost: one template rendering and one tokenization of the piece a tool turn (~1 ms).
"""

from __future__ import annotations

from collections.abc import Sequence

_USER = "\u2063user\u2063"
_ASSISTANT = "\u2063assistant\u2063"


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
        self.tool_text([("probe", "probe")])  # a template that cannot render tool turns: now

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
        """``tool_text`` as token ids (special tokens matched as the template's text has them)."""
        return list(self.tokenizer(self.tool_text(results), add_special_tokens=False)
                    ["input_ids"])

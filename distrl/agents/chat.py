"""Token ids of chat messages through the model's own chat template, as *deltas*, so that a trajectory is exactly
the ids the engine saw and sampled.

The next turn's prompt is the previous prompt's ids, the ids the model generated (its end-of-turn token
included), and the ids of the observation rendered by the chat template: what the template writes after an
assistant message's end-of-turn token, then the new messages, then the generation prompt. The delta is taken
between two renderings of a fixed conversation, without and with the observation, so the template decides every
character (role headers, tool-response wrappers, the tools' schemas in a system prompt); the model's own tokens are
never decoded and re-encoded. Re-rendering the whole conversation as text and tokenizing it is *not* token-exact
(a model may sample a non-canonical split of its text; templates rewrite past turns): `template_drift` says
whether it would have differed, for the record.
"""

from __future__ import annotations

from typing import Any

_PROBE = [{"role": "user", "content": "distrl-probe-question"},
          {"role": "assistant", "content": "distrl-probe-answer"}]
"""The fixed conversation the observation deltas are taken after."""


class ChatTemplateError(ValueError):
    """The chat template cannot render an observation as a delta (it rewrites earlier text when messages follow)."""


class ChatRenderer:
    """Renders through `tokenizer`'s chat template (a transformers tokenizer with `apply_chat_template`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _text(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        # A rendered template already holds its special tokens (BOS included).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """The first prompt: `messages` with `tools` offered, and the generation prompt."""
        return self._ids(self._text(messages, tools, generation_prompt=True))

    def observation_ids(self, messages: list[dict], tools: list[dict], end_of_turn: int) -> list[int]:
        """The ids that follow a model turn ended by token `end_of_turn` when `messages` answer it: the template's
        text after that token, the messages, and the generation prompt of the next turn."""
        before = self._text(_PROBE, tools, generation_prompt=False)
        after = self._text([*_PROBE, *messages], tools, generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError("the chat template renders an assistant message differently once messages "
                                    "follow it, so an observation cannot be appended as a delta of tokens")
        eot = self.tokenizer.decode([end_of_turn])
        answer_end = before.rfind(_PROBE[-1]["content"]) + len(_PROBE[-1]["content"])
        at = before.find(eot, answer_end) if eot else -1
        if at < 0:
            raise ChatTemplateError(f"the chat template does not end an assistant message with the token the turn "
                                    f"ended with ({eot!r}, id {end_of_turn}): the model must end its turns with the "
                                    f"token its template writes there (the tokenizer's eos_token)")
        return self._ids(before[at + len(eot):] + after[len(before):])

    def template_drift(self, messages: list[dict], tools: list[dict], trajectory: list[int]) -> bool:
        """Whether rendering the whole conversation `messages` as text and tokenizing it gives other ids than
        `trajectory` (the prompt and response ids, which end with a model turn)."""
        rendered = self._ids(self._text(messages, tools, generation_prompt=False))
        return rendered[: len(trajectory)] != trajectory

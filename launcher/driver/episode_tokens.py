"""The token ids of a multi-turn episode: the model's tokens exactly as the engine generated them
(never re-tokenized from text) and, between its turns, the environment's messages as the
tokenizer's chat template renders them.

After a model turn the template would have written the rest of the assistant turn (ChatML's
`<|im_end|>\\n`, Llama 3's `<|eot_id|>`) and then the new messages and the next generation prompt.
Both are read off whole renderings of the conversation, so whatever the template puts around a
message (a default system prompt, separators, the tools block) is where it puts it:
  - the end of an assistant turn: what the template writes after the content of an assistant
    message (rendered with a marker as its content: the template may reformat a real reply), less
    the special tokens the model generated itself at the end of its reply (its end-of-turn token);
  - the new messages: the rendering of the conversation with them and the generation prompt, after
    the rendering of the conversation without them. A template whose renderings are not prefixes of
    each other (one that rewrites earlier turns) cannot be extended turn by turn: an error naming it.
"""

from __future__ import annotations

MARK = "\u2063episode-reply\u2063"   # invisible separator characters: never in a real reply


class TemplateError(ValueError):
    """The chat template cannot render an episode turn by turn (one line)."""


class EpisodeTokens:
    """Renders an episode's messages with `tokenizer`'s chat template (with `tools` when given)."""

    def __init__(self, tokenizer, tools: list | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("env.fn needs a tokenizer with a chat template (the environment's messages are "
                                "rendered with it); this tokenizer has none")
        self.tokenizer, self.tools = tokenizer, tools or None
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(self, messages: list[dict]) -> list[int]:
        """The prompt of the first turn: the messages and the generation prompt, as the template renders them."""
        return self.ids(self.render(messages, True))

    def after_reply(self, history: list[dict], reply_ids: list[int], new: list[dict]) -> list[int]:
        """The tokens after the model's reply `reply_ids` (to the conversation `history`): the rest of
        its assistant turn, the messages `new`, and the next generation prompt."""
        asked = self.render(history, True)
        with_reply = self.render(history + [{"role": "assistant", "content": MARK}], False)
        if not with_reply.startswith(asked) or MARK not in with_reply[len(asked):]:
            raise TemplateError("the chat template does not render an assistant reply after its generation prompt: "
                                "it cannot run multi-turn episodes")
        turn_end = with_reply[with_reply.index(MARK, len(asked)) + len(MARK):]
        extended = self.render(history + [{"role": "assistant", "content": MARK}] + new, True)
        if not extended.startswith(with_reply):
            raise TemplateError("the chat template renders earlier turns differently once a message follows them "
                                "(it rewrites the conversation): it cannot run multi-turn episodes")
        added = extended[len(with_reply):]
        lost = [m for m in new if str(m.get("content", "")).strip() and str(m["content"]).strip() not in added]
        if lost:  # e.g. a role the template has no branch for: the model would never see the message
            raise TemplateError(f"the chat template does not render the environment's {lost[0].get('role')!r} "
                                f"message (its content is not in the rendering): answer with a role the template "
                                f"renders (user, tool, ...)")
        generated_end = self._trailing_special(reply_ids)
        tail = turn_end[len(generated_end):] if generated_end and turn_end.startswith(generated_end) else turn_end
        return self.ids(tail + added)

    def _trailing_special(self, reply_ids: list[int]) -> str:
        """The text of the special tokens the reply ends with (the model's end of turn), if any."""
        k = len(reply_ids)
        while k and reply_ids[k - 1] in self.special:
            k -= 1
        return self.tokenizer.decode(reply_ids[k:], skip_special_tokens=False) if k < len(reply_ids) else ""

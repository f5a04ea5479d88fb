"""env.fn=tools: the built-in tool-calling environment. The model sees the functions of `env.tools`
through the chat template's `tools` (their JSON schemas, launcher.driver.tool_calls.schema); each
reply's Hermes-style calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format the
Qwen2.5/Qwen3/Hermes templates declare) are run and their results appended as `tool` messages; a
reply without a call is the final answer and ends the episode (reward.fn scores it, against the
record's data.answer_key as for single-turn samples). A call that cannot be read, names no tool, does
not fit its signature or raises is answered with an `error: ...` tool message: it costs the model a
turn, not the run. Counted per episode as env/tool_calls and env/tool_errors.

The first messages are the record's, as single-turn prompts are (data.prompt_key or
data.messages_key, data.system_prompt).
"""

from __future__ import annotations

from typing import Callable

from launcher.config.schema import Data
from launcher.driver import tool_calls
from launcher.driver.data import conversation


class ToolEnv:
    def __init__(self, example: dict, tools: dict[str, Callable], data: dict, schemas: list[dict] | None = None):
        """`schemas`: the tools' JSON schemas, computed once per worker (launcher.driver.environments
        .init_worker: outside any call's timeout, transformers imported there); else here."""
        self.example, self.functions, self.data = example, tools, Data(**data)
        self.tools = schemas if schemas is not None else [tool_calls.schema(fn, name) for name, fn in tools.items()]

    def first_messages(self) -> list[dict]:
        d = self.data
        return conversation(self.example.get(d.prompt_key), self.example[d.messages_key] if d.messages_key else None, d)

    def respond(self, reply: str) -> dict:
        calls, problems = tool_calls.parse(reply)
        if not calls and not problems:
            return {"messages": [], "reward": 0.0, "done": True, "metrics": {"tool_calls": 0, "tool_errors": 0}}
        messages, errors = [], len(problems)
        for call in calls:
            text, ok = tool_calls.run(self.functions, call)
            messages.append({"role": "tool", "name": call["name"], "content": text})
            errors += not ok
        messages += [{"role": "tool", "content": f"error: {p}"} for p in problems]
        return {"messages": messages, "reward": 0.0, "done": False,
                "metrics": {"tool_calls": len(calls), "tool_errors": errors}}

"""Tool calls in the Hermes style: what a model's reply asks for, the schemas that describe the tools, and
running them.

The format is the one the Qwen2.5 / Qwen3 / Hermes chat templates declare in their system prompt and
render in assistant turns: each call is a JSON object `{"name": ..., "arguments": {...}}` inside
`<tool_call>...</tool_call>`, and each result goes back as a `{"role": "tool", "content": text}` message
(the templates show it inside `<tool_response>`). Parsing is as lenient as the field's parsers (vLLM's
`hermes` tool parser, Qwen-Agent's NousFnCallPrompt): whitespace around the JSON, `arguments` written as a
JSON string that holds an object, and a call whose closing tag never came (generation stopped on
`</tool_call>`, or at the end of the reply) when its JSON is complete. What cannot be read is one line per
call, never an exception: the environment shows it to the model, or counts it.

User tools are plain Python functions (`path/to/file.py:fn` or `pkg.module:fn`, loaded as reward
functions are: launcher.driver.rewards.load_callable). A tool that raises, or arguments that do not fit
its signature, give an `error: ...` line as the tool's answer, so a bad call costs the model a turn, not
the run.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable

from launcher.config.schema import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY = "env.tools"
_SHOWN = 80   # characters of a malformed call quoted in its problem line


# ---------------------------------------------------------------------------- reading a reply
def parse(text: str) -> tuple[list[dict], list[str]]:
    """The tool calls of a model reply in order, each {"name": str, "arguments": dict}, and one line per
    call that cannot be read (its number among the reply's `<tool_call>` tags, what is wrong, the start
    of its text). Reasoning before the last `</think>` is not searched: a call the model only thought
    about is not made (as vLLM's reasoning parsers and Qwen-Agent split it off first)."""
    text = text.rpartition("</think>")[2] if "</think>" in text else text
    calls, problems = [], []
    segments = text.split(OPEN)[1:]
    for i, segment in enumerate(segments, start=1):
        body, closed, _ = segment.partition(CLOSE)
        call, why = _one_call(body.strip(), closed == CLOSE, i == len(segments))
        if call is not None:
            calls.append(call)
        else:
            problems.append(f"tool call {i}: {why}: {_quote(body)}")
    return calls, problems


def _one_call(body: str, closed: bool, last: bool) -> tuple[dict | None, str]:
    """(the call, '') or (None, what is wrong) for the text inside one `<tool_call>` tag. Unclosed (the
    reply ended, or another `<tool_call>` began) it still counts when its JSON is complete, as vLLM's
    hermes parser reads a call "until EOS"."""
    if not body and closed:
        return None, "empty"
    try:
        obj = json.loads(body)
    except ValueError as e:
        if not closed:
            return None, "unclosed <tool_call> (the reply ended inside it: truncated?)" if last else \
                "no </tool_call> before the next <tool_call>"
        return None, f"bad JSON ({e.msg} at character {e.pos})" if isinstance(e, json.JSONDecodeError) else \
            f"bad JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object but {_json_kind(obj)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, "no \"name\" string" if name is None else f"\"name\" is {_json_kind(name)}, not a name"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # serialised once more, as Granite 4 and some fine-tunes write it
        try:
            args = json.loads(args)
        except ValueError:
            return None, "\"arguments\" is a string that holds no JSON object"
    if not isinstance(args, dict):
        return None, f"\"arguments\" is {_json_kind(args)}, not an object"
    return {"name": name, "arguments": args}, ""


def _json_kind(value: Any) -> str:
    """A JSON value's kind, for the problem lines ('an array', 'a number', ...)."""
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
             type(None): "null", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _quote(body: str) -> str:
    """The start of a call's text on one line (newlines shown as spaces)."""
    flat = " ".join(body.split())
    return repr(flat if len(flat) <= _SHOWN else flat[:_SHOWN - 3] + "...")


# ---------------------------------------------------------------------------- describing a tool
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array",
               set: "array", dict: "object", type(None): "null"}


def schema(fn: Callable, name: str | None = None) -> dict:
    """The OpenAI / HF "function" schema of a tool, what `apply_chat_template(tools=[...])` takes:
    {"type": "function", "function": {"name", "description", "parameters": {"type": "object",
    "properties", "required"}}}. transformers' get_json_schema when it can (a Google-style docstring with
    an Args entry per parameter, every parameter annotated); otherwise built from the signature the same
    way: str/int/float/bool/list/dict as string/integer/number/boolean/array/object, Optional[X] as X
    nullable, Literal as an enum, anything else or unannotated without a type; the description is the
    docstring's first line, and a parameter's the Args entry the docstring has for it. "required" is left
    out when empty, as get_json_schema does. `name` replaces the function's own (a tool loaded as
    `file.py:alias` is called by the model as `alias`)."""
    try:
        from transformers.utils import get_json_schema

        out = get_json_schema(fn)
    except Exception:  # noqa: BLE001 - no docstring, no Args, a missing annotation, no transformers
        out = _schema_from_signature(fn)
    if name is not None:
        out["function"]["name"] = name
    return out


def _schema_from_signature(fn: Callable) -> dict:
    """get_json_schema's shape from the signature and annotations alone (see schema)."""
    doc = inspect.getdoc(fn) or ""
    described = _arg_descriptions(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that names something undefined: read them as written
        hints = {}
    properties, required = {}, []
    for p in _parameters(fn):
        prop = _json_type(hints.get(p.name, p.annotation))
        if p.name in described:
            prop["description"] = described[p.name]
        properties[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    description = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    return {"type": "function", "function": {"name": getattr(fn, "__name__", type(fn).__name__),
                                             "description": description, "parameters": parameters}}


def _parameters(fn: Callable) -> list[inspect.Parameter]:
    """The parameters a model can pass by name: not *args / **kwargs, not positional-only."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return []
    return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _arg_descriptions(doc: str) -> dict[str, str]:
    """A Google-style docstring's Args entries (transformers' reader), {} without transformers or Args."""
    try:
        from transformers.utils.chat_template_utils import parse_google_format_docstring

        return parse_google_format_docstring(doc)[1] or {}
    except Exception:  # noqa: BLE001 - best effort: descriptions only
        return {}


def _json_type(annotation: Any) -> dict:
    """The JSON schema of one annotation: {} where it says nothing JSON can check."""
    if isinstance(annotation, str):  # a `from __future__ import annotations` hint that did not resolve
        simple = {t.__name__: t for t in _JSON_TYPES if t is not type(None)}
        annotation = simple.get(annotation.strip(), annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in _JSON_TYPES:  # list[str], dict[str, int], tuple[int, int]
        return {"type": _JSON_TYPES[origin]}
    if origin is typing.Literal and args:
        kinds = sorted({_JSON_TYPES[type(a)] for a in args if type(a) in _JSON_TYPES})
        return ({"type": kinds[0] if len(kinds) == 1 else kinds} if kinds else {}) | {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):  # Optional[int] -> integer, nullable; int | str -> [integer, string]
        inner = [_json_type(a) for a in args if a is not type(None)]
        simple = all(list(t) == ["type"] and isinstance(t["type"], str) for t in inner)
        kinds = sorted({t["type"] for t in inner}) if simple else []
        out = inner[0] if len(inner) == 1 else {"type": kinds[0] if len(kinds) == 1 else kinds} if kinds else {}
        return out | {"nullable": True} if type(None) in args and out else out
    return {}


# ---------------------------------------------------------------------------- running a call
def run(tools: dict[str, Callable], call: dict) -> tuple[str, bool]:
    """(the tool's answer as text, True) or (an `error: ...` line, False) for one parsed call: an unknown
    tool, arguments that do not bind to its signature, an exception in it (SystemExit included; Ctrl-C
    still interrupts), or a result that cannot be shown as text. A str result is given as is, anything else
    as JSON (str() where JSON cannot hold it). An `async def` tool is run to its end (asyncio.run)."""
    from launcher.driver.rewards import _what

    name, args = call.get("name"), call.get("arguments") or {}
    fn = tools.get(name) if isinstance(name, str) else None
    if fn is None:
        return f"error: unknown tool {name!r}; tools: {', '.join(tools) or '(none)'}", False
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        return f"error: {name}{_signature(fn)} cannot take {_quote(json.dumps(args, default=str))}: {e}", False
    except ValueError:  # no signature to inspect (a builtin): the call itself will say
        pass
    try:
        value = fn(**args)
        if inspect.iscoroutine(value):
            import asyncio

            value = asyncio.run(value)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's tool: the model sees what went wrong
        return f"error: {_what(e, 'tool')}", False
    return _as_text(value)


def _signature(fn: Callable) -> str:
    """The tool's parameters as the model is shown them in an error (annotations as written, not quoted)."""
    try:
        return str(inspect.signature(fn, eval_str=True))
    except Exception:  # noqa: BLE001 - an annotation that names something undefined
        try:
            return str(inspect.signature(fn))
        except (TypeError, ValueError):
            return "(...)"


def _as_text(value: Any) -> tuple[str, bool]:
    """A tool's result as the text of its message."""
    if isinstance(value, str):
        return value, True
    try:
        return json.dumps(value, ensure_ascii=False), True
    except (TypeError, ValueError):  # a set, an object, a circular list: its str()
        pass
    try:
        return str(value), True
    except Exception as e:  # noqa: BLE001 - the user's __str__
        return f"error: the tool's result ({type(value).__name__}) cannot be shown as text: " \
               f"{type(e).__name__}", False


# ---------------------------------------------------------------------------- loading the tools
def load_tools(specs: list[str], run_dir: Path | None = None) -> dict[str, Callable]:
    """{name: function} of `env.tools`, each spec loaded by `load_one` and named by the part after the colon
    (the name the model calls). ConfigError("env.tools", one line) for a spec that cannot be loaded and for
    two tools of one name."""
    tools: dict[str, Callable] = {}
    where: dict[str, str] = {}
    for spec in specs:
        if not isinstance(spec, str):
            raise ConfigError(KEY, f"{spec!r} is neither path/to/file.py:function nor pkg.module:function")
        name = spec.rpartition(":")[2]
        if name in tools:
            raise ConfigError(KEY, f"two tools are named {name!r} ({where[name]} and {spec}): the model calls "
                                   f"tools by name")
        tools[name] = load_one(spec, run_dir)
        where[name] = spec
    return tools


def load_one(spec: str, run_dir: Path | None = None) -> Callable:
    """The function of one `path/to/file.py:fn` or `pkg.module:fn` spec (what rewards.probe imports at
    submission). With run_dir, a file spec loads the run's copy (RUN/env/<file>, made at submission) when
    there is one. ConfigError("env.tools", one line) when it cannot be had."""
    from launcher import paths
    from launcher.driver.rewards import file_part, load_callable, run_copy

    copy = run_copy(run_dir, spec, paths.ENV_DIR) if run_dir is not None and file_part(spec) else None
    return load_callable(spec, KEY, "tool", copy if copy is not None and copy.is_file() else None)

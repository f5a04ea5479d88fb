"""launcher.driver.tool_calls: Hermes-style tool calls read from a reply, tool schemas, running and loading tools.

The vectors come from sources this project did not write, each named where it is used: vLLM's hermes tool parser
tests (vllm-project/vllm, tests/tool_parsers/test_hermes_tool_parser.py at 0eb73d6a09be117cdd0d4da4d6239321001c0d0c),
the installed vLLM's Hermes2ProToolParser run side by side, Qwen-Agent's NousFnCallPrompt (QwenLM/Qwen-Agent,
qwen_agent/llm/fncall_prompts/nous_fncall_prompt.py at 06a190465090cc15f73d539529e314a9cc1d99da), transformers'
get_json_schema (its docstring's example) and the published Qwen2.5-0.5B-Instruct chat template
(tests/fixtures/qwen2_5_chat_template.jinja, source at `qwen_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

import pytest

from launcher.config.schema import ConfigError
from launcher.driver import tool_calls as tc

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_TESTS = "vllm tests/tool_parsers/test_hermes_tool_parser.py"


# ---------------------------------------------------------------------------- parse: vectors of the field
@pytest.mark.parametrize("text, calls", [
    # VLLM_TESTS test_hermes_parser_non_streaming_no_tool_call
    ("This is not a tool call.", []),
    # VLLM_TESTS test_hermes_parser_non_streaming_tool_call_between_tags
    ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
     [{"name": "final_answer", "arguments": {"trigger": True}}]),
    # VLLM_TESTS test_hermes_parser_non_streaming_tool_call_until_eos: a complete call without its closing tag
    ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
     [{"name": "final_answer", "arguments": {"trigger": True}}]),
    # VLLM_TESTS test_hermes_parser_non_streaming_serialized_arguments: arguments serialised once more (Granite 4)
    ('<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
     [{"name": "get_db_config", "arguments": {"param": "max_connections"}}]),
    # VLLM_TESTS test_hermes_streaming_multiple_tool_calls_with_stream_interval: two calls, in order
    ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
     '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
     [{"name": "search", "arguments": {"q": "cats"}}, {"name": "search", "arguments": {"q": "dogs"}}]),
    # VLLM_TESTS test_hermes_streaming_content_then_tool_call_with_stream_interval: text before the call
    ('Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}</tool_call>',
     [{"name": "get_weather", "arguments": {"city": "NYC"}}]),
    # VLLM_TESTS test_hermes_parser_streaming, with the line breaks inside the JSON made real newlines
    ('<tool_call>\n{"name": "get_current_temperature",\n"arguments": {"location":\n"San Francisco, California, '
     'United States", "unit": "celsius"}}\n</tool_call>',
     [{"name": "get_current_temperature",
       "arguments": {"location": "San Francisco, California, United States", "unit": "celsius"}}]),
])
def test_the_field_s_vectors_parse_as_vllm_reads_them(text, calls):
    assert tc.parse(text) == (calls, [])


@pytest.mark.parametrize("text, problem", [
    # VLLM_TESTS test_hermes_parser_non_streaming_tool_call_invalid_json ("Missing closing brace"): truncated
    ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
     "tool call 1: unclosed <tool_call> (the reply ended inside it: truncated?): "
     "'{\"name\": \"final_answer\", \"arguments\": {\"trigger\": true}'"),
    # VLLM_TESTS test_hermes_parser_non_streaming_bare_string_arguments: vLLM passes "hello" on as the arguments;
    # a Python function needs keyword arguments, so here it is a malformed call
    ('<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>',
     "tool call 1: \"arguments\" is a string that holds no JSON object: '{\"name\": \"do_thing\", \"arguments\": "
     "\"hello\"}'"),
    # VLLM_TESTS test_hermes_streaming_string_arguments_match_non_streaming: strings that only look structured
    (f'<tool_call>{json.dumps({"name": "f", "arguments": "[oops"})}</tool_call>',
     "tool call 1: \"arguments\" is a string that holds no JSON object: '{\"name\": \"f\", \"arguments\": \"[oops\"}'"),
    (f'<tool_call>{json.dumps({"name": "f", "arguments": "{hello world}"})}</tool_call>',
     "tool call 1: \"arguments\" is a string that holds no JSON object: '{\"name\": \"f\", \"arguments\": "
     "\"{hello world}\"}'"),
])
def test_what_vllm_cannot_read_is_one_line_per_call(text, problem):
    assert tc.parse(text) == ([], [problem])


def test_qwen_agent_s_rendering_of_a_call_parses_back():
    # Qwen-Agent NousFnCallPrompt.preprocess_fncall_messages writes a call as
    # f'<tool_call>\n{json.dumps({"name": ..., "arguments": ...}, ensure_ascii=False)}\n</tool_call>'
    fc = {"name": "get_weather", "arguments": {"city": "北京", "days": [1, 2], "metric": None}}
    written = "Let me look.\n" + f"<tool_call>\n{json.dumps(fc, ensure_ascii=False)}\n</tool_call>"
    assert tc.parse(written) == ([fc], [])


def test_the_installed_vllm_hermes_parser_agrees_on_well_formed_replies():
    """Differential check: vLLM's Hermes2ProToolParser.extract_tool_calls (its arguments are a JSON string)."""
    hermes = pytest.importorskip("vllm.tool_parsers.hermes_tool_parser")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from workers.tiny_models import make_tokenizer

    parser = hermes.Hermes2ProToolParser(make_tokenizer(chat=True))
    request = ChatCompletionRequest(model="m", messages=[])
    replies = [
        "no call here",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        'thinking aloud\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"x": 2.5, "y": -3, "note": "ü \\"q\\""}}\n</tool_call>',
        '<tool_call>  {"arguments": {"nested": {"k": [1, {"z": null}]}}, "name": "deep"}  </tool_call> trailing',
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
    ]
    for reply in replies:
        got = parser.extract_tool_calls(reply, request)
        theirs = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in got.tool_calls]
        assert tc.parse(reply) == (theirs, []), reply


# ---------------------------------------------------------------------------- parse: malformed calls
def test_each_malformed_call_is_one_line_and_the_good_ones_still_count():
    text = ("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>{\"arguments\": {\"x\": 1}}</tool_call>"             # 2: no name
            "<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>"         # 3: name not a string
            "<tool_call>{\"name\": \"b\", \"arguments\": [1, 2]}</tool_call>"  # 4: arguments an array
            "<tool_call>[{\"name\": \"c\"}]</tool_call>"                      # 5: not an object
            "<tool_call>{\"name\": \"d\", \"arguments\": {'x': 1}}</tool_call>"  # 6: not JSON
            "<tool_call></tool_call>"                                         # 7: empty
            "<tool_call>{\"name\": \"e\", \"argu"                              # 8: cut by the next call
            "<tool_call>{\"name\": \"f\"}</tool_call>"                         # 9: no arguments: none needed
            "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"s\": \"")       # 10: truncated at the end
    calls, problems = tc.parse(text)
    assert calls == [{"name": "a", "arguments": {}}, {"name": "f", "arguments": {}}]
    assert problems == [
        "tool call 2: no \"name\" string: '{\"arguments\": {\"x\": 1}}'",
        "tool call 3: \"name\" is a number, not a name: '{\"name\": 7, \"arguments\": {}}'",
        "tool call 4: \"arguments\" is an array, not an object: '{\"name\": \"b\", \"arguments\": [1, 2]}'",
        "tool call 5: not a JSON object but an array: '[{\"name\": \"c\"}]'",
        "tool call 6: bad JSON (Expecting property name enclosed in double quotes at character 28): "
        "'{\"name\": \"d\", \"arguments\": {\\'x\\': 1}}'",
        "tool call 7: empty: ''",
        "tool call 8: no </tool_call> before the next <tool_call>: '{\"name\": \"e\", \"argu'",
        "tool call 10: unclosed <tool_call> (the reply ended inside it: truncated?): "
        "'{\"name\": \"g\", \"arguments\": {\"s\": \"'",
    ]


def test_a_long_or_multiline_malformed_call_is_still_one_short_line():
    body = '{"name": "f",\n "arguments": {"text": "' + "x" * 500 + '"}\n'  # no closing brace
    [problem] = tc.parse(f"<tool_call>{body}</tool_call>")[1]
    assert "\n" not in problem and len(problem) < 200 and problem.endswith("...'")


def test_calls_inside_the_reasoning_are_not_made():
    text = ('<think>I could call <tool_call>{"name": "rm", "arguments": {}}</tool_call>, better not.</think>\n'
            '<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>')
    assert tc.parse(text) == ([{"name": "ls", "arguments": {"path": "."}}], [])


# ---------------------------------------------------------------------------- the Qwen2.5 chat template
@pytest.fixture(scope="module")
def qwen_tokenizer():
    """A local word-level tokenizer (no hub) carrying the published Qwen2.5-0.5B-Instruct chat template:
    tests/fixtures/qwen2_5_chat_template.jinja is, byte for byte, `qwen2dot5_it_template` of guidance-ai/guidance
    guidance/chat.py (HEAD 5413339aad8d36ce49df29902a7730d025bd6027), which it copies "From
    https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/7ae557604adf67be50417f59c2c2f167def9a775/
    tokenizer_config.json#L198"; mattt/Jinja Tests/JinjaTests/IntegrationTests.swift ("Qwen Qwen2.5-0.5B-Instruct",
    86566177673481019a85a19823c30626367d6ef7) holds the same text less the final newline."""
    from workers.tiny_models import make_tokenizer

    tok = make_tokenizer(chat=True)
    tok.chat_template = (FIXTURES / "qwen2_5_chat_template.jinja").read_text()
    return tok


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def lookup(city, units: str = "metric", *, days: int):
    return {"city": city, "units": units, "days": days}


def test_the_template_shows_the_schema_s_name_and_parameters(qwen_tokenizer):
    tools = [tc.schema(add), tc.schema(lookup)]
    prompt = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                                add_generation_prompt=True)
    shown = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in shown] == tools   # the template writes each tool as `tool | tojson`
    assert '"name": "add"' in shown[0] and '"a": {"type": "integer", "description": "the first number"}' in shown[0]
    assert '"name": "lookup"' in shown[1] and '"required": ["city", "days"]' in shown[1]
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_call_the_template_renders_parses_back_and_a_tool_message_is_a_tool_response(qwen_tokenizer):
    call = {"name": "lookup", "arguments": {"city": "Zürich", "days": 2}}
    answer, ok = tc.run({"lookup": lookup}, call)
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": answer}]
    text = qwen_tokenizer.apply_chat_template(messages, tools=[tc.schema(lookup)], tokenize=False)
    turn = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    assert turn == ('Checking.\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Zürich", "days": 2}}\n'
                    '</tool_call>')
    assert tc.parse(turn) == ([call], [])
    assert ok and text.endswith('<|im_start|>user\n<tool_response>\n'
                                '{"city": "Zürich", "units": "metric", "days": 2}\n</tool_response><|im_end|>\n')


# ---------------------------------------------------------------------------- schema
def test_a_documented_function_s_schema_is_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    def multiply(x: float, y: float):
        """
        A function that multiplies two numbers

        Args:
            x: The first number to multiply
            y: The second number to multiply
        """
        return x * y

    # the expected value is the example in get_json_schema's own docstring (transformers/utils/chat_template_utils.py)
    assert tc.schema(multiply) == get_json_schema(multiply) == {"type": "function", "function": {
        "name": "multiply", "description": "A function that multiplies two numbers",
        "parameters": {"type": "object", "properties": {
            "x": {"type": "number", "description": "The first number to multiply"},
            "y": {"type": "number", "description": "The second number to multiply"}},
            "required": ["x", "y"]}}}
    assert tc.schema(add) == get_json_schema(add)


def test_without_a_docstring_the_schema_comes_from_the_signature():
    def f(s: str, i: int, x: float, flag: bool, items: list, opts: dict, free, maybe: Optional[int] = None,
          mode: Literal["a", "b"] = "a", either: int | str = 0, names: list[str] = (), seq: list | tuple = (),
          *rest, **more):
        return s

    assert tc.schema(f) == {"type": "function", "function": {"name": "f", "description": "", "parameters": {
        "type": "object", "properties": {
            "s": {"type": "string"}, "i": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"},
            "items": {"type": "array"}, "opts": {"type": "object"}, "free": {},
            "maybe": {"type": "integer", "nullable": True}, "mode": {"type": "string", "enum": ["a", "b"]},
            "either": {"type": ["integer", "string"]}, "names": {"type": "array"}, "seq": {"type": "array"}},
        "required": ["s", "i", "x", "flag", "items", "opts", "free"]}}}


def test_a_docstring_without_args_gives_its_first_line_and_the_args_it_has():
    def g(q: str, limit=3):
        """Search the notes.

        Args:
            q: what to look for
        """

    def h():
        """Now, as an ISO string.

        More words."""

    assert tc.schema(g)["function"] == {"name": "g", "description": "Search the notes.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "description": "what to look for"}, "limit": {}},
        "required": ["q"]}}
    # no parameter to describe: get_json_schema takes it, with the whole text before Args as the description
    assert tc.schema(h) == {"type": "function", "function": {"name": "h", "description": "Now, as an ISO string.\n\n"
                                                             "More words.", "parameters": {"type": "object",
                                                                                           "properties": {}}}}
    assert tc.schema(h, name="clock")["function"]["name"] == "clock"


# ---------------------------------------------------------------------------- run
def divide(a: float, b: float) -> float:
    return a / b


TOOLS = {"add": add, "divide": divide, "lookup": lookup, "echo": lambda text: text,
         "as_set": lambda: {1}, "none": lambda: None, "bye": lambda: exit(3)}


@pytest.mark.parametrize("call, answer", [
    ({"name": "add", "arguments": {"a": 40, "b": 2}}, ("42", True)),
    ({"name": "add", "arguments": {"a": 40}}, ("42", True)),
    ({"name": "echo", "arguments": {"text": "plain text"}}, ("plain text", True)),
    ({"name": "lookup", "arguments": {"city": "Oslo", "days": 1}},
     ('{"city": "Oslo", "units": "metric", "days": 1}', True)),
    ({"name": "as_set", "arguments": {}}, ("{1}", True)),
    ({"name": "none", "arguments": {}}, ("null", True)),
    ({"name": "nope", "arguments": {}}, ("error: unknown tool 'nope'; tools: add, divide, lookup, echo, as_set, none, "
                                         "bye", False)),
    ({"name": "divide", "arguments": {"a": 1, "b": 0}}, ("error: ZeroDivisionError: division by zero", False)),
    ({"name": "add", "arguments": {"b": 1}},
     ("error: add(a: int, b: int = 2) -> int cannot take '{\"b\": 1}': missing a required argument: 'a'", False)),
    ({"name": "add", "arguments": {"a": 1, "c": 2}},
     ("error: add(a: int, b: int = 2) -> int cannot take '{\"a\": 1, \"c\": 2}': got an unexpected keyword "
      "argument 'c'", False)),
    ({"name": "bye", "arguments": {}},
     ("error: it called sys.exit(3) (SystemExit): a tool module must not exit", False)),
])
def test_run_answers_with_text_and_says_what_went_wrong_in_one_line(call, answer):
    assert tc.run(TOOLS, call) == answer


def test_an_async_tool_is_awaited():
    async def fetch(url: str) -> dict:
        return {"url": url, "status": 200}

    assert tc.run({"fetch": fetch}, {"name": "fetch", "arguments": {"url": "u"}}) == ('{"url": "u", "status": 200}',
                                                                                     True)


def test_run_lets_ctrl_c_through():
    def slow():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tc.run({"slow": slow}, {"name": "slow", "arguments": {}})


# ---------------------------------------------------------------------------- load_tools
TOOL_FILE = '''
def search(query: str) -> str:
    """Search.

    Args:
        query: words
    """
    return "found " + query

count = 3
'''


def test_load_tools_from_files_and_modules(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(TOOL_FILE)
    (tmp_path / "pkg_tools.py").write_text("def add(a: int, b: int):\n    return a + b\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = tc.load_tools([f"{tmp_path}/my_tools.py:search", "pkg_tools:add"])
    assert list(tools) == ["search", "add"]
    assert tc.run(tools, {"name": "search", "arguments": {"query": "x"}}) == ("found x", True)
    assert tc.run(tools, {"name": "add", "arguments": {"a": 1, "b": 2}}) == ("3", True)
    assert tc.load_tools([]) == {}
    assert tc.load_one("pkg_tools:add")(2, 3) == 5   # one spec: what the submission's probe imports


def test_load_tools_prefers_the_run_s_copy(tmp_path):
    from launcher import paths

    (tmp_path / "my_tools.py").write_text(TOOL_FILE)
    run = tmp_path / "run"
    (run / paths.ENV_DIR).mkdir(parents=True)
    (run / paths.ENV_DIR / "my_tools.py").write_text("def search(query: str):\n    return 'copy'\n")
    spec = f"{tmp_path}/my_tools.py:search"
    assert tc.run(tc.load_tools([spec], run_dir=run), {"name": "search", "arguments": {"query": "q"}})[0] == "copy"
    assert tc.run(tc.load_tools([spec]), {"name": "search", "arguments": {"query": "q"}})[0] == "found q"


@pytest.mark.parametrize("specs, message", [
    (["{dir}/my_tools.py:search", "{dir}/other/my_tools.py:search"],
     "env.tools: two tools are named 'search' ({dir}/my_tools.py:search and {dir}/other/my_tools.py:search): the "
     "model calls tools by name"),
    (["{dir}/nope.py:f"], "env.tools: {dir}/nope.py: no such file"),
    (["{dir}/my_tools.py:missing"], "env.tools: {dir}/my_tools.py:missing: the module has no 'missing'"),
    (["{dir}/my_tools.py:count"], "env.tools: {dir}/my_tools.py:count: 'count' is not callable"),
    (["{dir}/exits.py:f"], "env.tools: cannot import {dir}/exits.py: it called sys.exit(2) (SystemExit): a tool "
                           "module must not exit"),
    (["{dir}/raises.py:f"], "env.tools: cannot import {dir}/raises.py: RuntimeError: no network | here"),
    (["no_such_pkg_here.mod:f"], "env.tools: cannot import module 'no_such_pkg_here.mod': ModuleNotFoundError: No "
                                 "module named 'no_such_pkg_here'"),
    (["search"], "env.tools: 'search' is neither pkg.module:function nor path/to/file.py:function"),
    ([3], "env.tools: 3 is neither path/to/file.py:function nor pkg.module:function"),
])
def test_load_tools_mistakes_are_one_line(tmp_path, specs, message):
    (tmp_path / "my_tools.py").write_text(TOOL_FILE)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "my_tools.py").write_text(TOOL_FILE)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(2)\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('no network\\nhere')\n")
    with pytest.raises(ConfigError) as e:
        tc.load_tools([s.format(dir=tmp_path) if isinstance(s, str) else s for s in specs])
    assert str(e.value) == message.format(dir=tmp_path)

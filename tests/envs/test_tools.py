"""dppo.envs.tools: tool schemas, Hermes tool-call parsing, prompting without template `tools` support, safe
calling (unknown tool, bad arguments, exceptions, hangs, truncation) and the `calculate` tool against Python."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from dppo.envs.tools import (
    ToolCall,
    ToolResult,
    calculate,
    call_tool,
    format_tool_message,
    malformed_result,
    parse_tool_calls,
    render_messages_with_tools,
    render_tools_prompt,
    template_supports_tools,
    tool_schema,
)
from dppo.runtime.models import char_tokenizer


def get_weather(city: str, days: int = 1, metric: bool = True) -> str:
    """Get the weather forecast for a city.

    Args:
        city: The city name.
        days: How many days ahead.
        metric: Whether to use degrees Celsius.
    """
    return f"{city}: sunny for {days} day(s)"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


# --- schema ----------------------------------------------------------------------------------------------------


def test_schema_of_typed_function():
    assert tool_schema(get_weather) == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city name."},
                    "days": {"type": "integer", "description": "How many days ahead."},
                    "metric": {"type": "boolean", "description": "Whether to use degrees Celsius."},
                },
                "required": ["city"],
            },
            "return": {"type": "string"},
        },
    }


def test_schema_of_bound_method_and_calculate():
    class Box:
        def put(self, item: str) -> str:
            """Put an item in the box.

            Args:
                item: What to put.
            """
            return item

    assert list(tool_schema(Box().put)["function"]["parameters"]["properties"]) == ["item"]
    assert tool_schema(calculate)["function"]["parameters"]["required"] == ["expression"]


def test_schema_errors_name_the_function():
    def undocumented_args(x: int) -> int:
        """Does something."""
        return x

    def no_hints(x):
        """Does something.

        Args:
            x: A thing.
        """

    for fn in (undocumented_args, no_hints):
        with pytest.raises(ValueError, match=fn.__name__):
            tool_schema(fn)


def test_a_callable_carrying_its_schema_is_passed_through_and_a_malformed_one_is_refused():
    """A tool defined elsewhere (an MCP server's, `dppo.envs.mcp`) carries its JSON schema: used unchanged, even where
    the signature and docstring would not give one."""
    schema = {"type": "function", "function": {"name": "lookup", "description": "Look up a key.",
                                               "parameters": {"type": "object", "properties": {"key-name": {}}}}}

    def lookup(**arguments):
        return arguments

    lookup.tool_schema = schema
    assert tool_schema(lookup) is schema
    lookup.tool_schema = {"type": "function", "function": {"description": "no name"}}
    with pytest.raises(ValueError, match=r"^tool .*lookup: its tool_schema attribute is not"):
        tool_schema(lookup)


# --- parsing ---------------------------------------------------------------------------------------------------


def test_parse_one_and_two_calls_ignoring_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("get_weather", {"city": "Paris"})], [])
    two = text + ' and <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> done'
    calls, errors = parse_tool_calls(two)
    assert calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("add", {"a": 1, "b": 2})] and errors == []


def test_parse_no_calls():
    assert parse_tool_calls("The answer is 4.") == ([], [])
    assert parse_tool_calls("stray </tool_call> closing tag") == ([], [])


@pytest.mark.parametrize("body, fragment", [
    ('{"name": "add", "arguments": {"a": 1,}}', "invalid JSON"),
    ('{"arguments": {"a": 1}}', "name"),
    ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
    ('["add"]', "JSON object"),
])
def test_parse_malformed_blocks(body, fragment):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("ok", {})]
    assert len(errors) == 1 and fragment in errors[0] and errors[0].startswith("tool call 1:")


def test_parse_unclosed_tag():
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert calls == [] and len(errors) == 1 and "unclosed" in errors[0]
    # an unclosed block followed by a good one: the good one still counts
    calls, errors = parse_tool_calls('<tool_call>{"name": "x"<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert calls == [ToolCall("add", {})] and len(errors) == 1 and "unclosed" in errors[0]


def test_parse_arguments_as_json_string_and_missing():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("add", {"a": 1, "b": 2})], [])
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == ([ToolCall("now", {})], [])
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "arguments": "not json"}</tool_call>')
    assert calls == [] and "not valid JSON" in errors[0]


# --- calling ---------------------------------------------------------------------------------------------------

TOOLS = {"add": add, "get_weather": get_weather, "calculate": calculate}


def test_call_success_and_message():
    result = call_tool(TOOLS, ToolCall("add", {"a": 2, "b": 3}))
    assert result == ToolResult("5", None, False, False)
    assert format_tool_message(result) == {"role": "tool", "content": "5"}
    assert call_tool({"d": lambda: {"x": [1, 2]}}, ToolCall("d", {})).content == json.dumps({"x": [1, 2]})


def test_call_unknown_tool_lists_valid_ones():
    result = call_tool(TOOLS, ToolCall("weather", {}))
    assert result.error == "unknown_tool" and "'weather'" in result.content
    assert "add, calculate, get_weather" in result.content


def test_call_bad_arguments():
    for args in ({"a": 1}, {"a": 1, "b": 2, "c": 3}):
        result = call_tool(TOOLS, ToolCall("add", args))
        assert result.error == "bad_arguments" and result.content.startswith("Error: bad arguments for tool add")


def test_call_raising_tool():
    result = call_tool(TOOLS, ToolCall("calculate", {"expression": "1/0"}))
    assert result == ToolResult("Error: ValueError: division by zero", "raised", False, False)

    def boom() -> str:
        raise KeyError("k")

    assert call_tool({"boom": boom}, ToolCall("boom", {})).content == "Error: KeyError: 'k'"


def test_call_hanging_tool_times_out():
    release = threading.Event()
    tools = {"hang": lambda: release.wait(30)}
    try:
        t0 = time.monotonic()
        result = call_tool(tools, ToolCall("hang", {}), timeout_s=0.2)
        assert time.monotonic() - t0 < 2.0
        assert result.timed_out and result.error == "timeout"
        assert result.content == "Error: tool hang timed out after 0.2s"
        # the pool still serves other calls while one worker hangs
        assert call_tool(TOOLS, ToolCall("add", {"a": 1, "b": 1}), timeout_s=5).content == "2"
    finally:
        release.set()


def test_call_truncates_long_output():
    result = call_tool({"long": lambda: "x" * 1500}, ToolCall("long", {}), max_chars=1000)
    assert result.truncated and result.error is None
    assert result.content == "x" * 1000 + "\n[truncated: 500 more characters]"
    assert not call_tool({"short": lambda: "x" * 1000}, ToolCall("short", {})).truncated


def test_malformed_result():
    result = malformed_result("tool call 1: invalid JSON")
    assert result.error == "malformed" and "invalid JSON" in result.content


# --- calculate -------------------------------------------------------------------------------------------------


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth >= 3 or rng.random() < 0.3:
        return rng.choice([str(rng.randint(0, 50)), f"{rng.uniform(0, 20):.2f}"])
    if rng.random() < 0.1:
        return f"-{_random_expression(rng, depth + 1)}"
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    if op == "**":  # a small exponent keeps Python's own result finite and real
        return f"({_random_expression(rng, depth + 1)}) ** {rng.randint(0, 3)}"
    return f"({_random_expression(rng, depth + 1)} {op} {_random_expression(rng, depth + 1)})"


def test_calculate_matches_python_arithmetic():
    rng, checked = random.Random(0), 0
    for _ in range(500):
        expr = _random_expression(rng)
        try:
            expected = eval(expr, {"__builtins__": {}})  # the reference, on expressions built here
        except ZeroDivisionError:
            with pytest.raises(ValueError, match="division by zero"):
                calculate(expr)
            continue
        got = calculate(expr)
        if isinstance(expected, int):
            assert got == str(expected), expr
        else:
            assert float(got) == expected, expr
            assert "." not in got or not expected.is_integer() or abs(expected) >= 1e15, expr
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("expr, value", [("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("7 / 2", "3.5"),
                                         ("6 / 3", "2"), ("-7 // 2", "-4"), ("-7 % 3", "2"), ("2 ** 10", "1024"),
                                         ("2 ** -1", "0.5"), ("- -3", "3"), ("0.1 + 0.2", "0.30000000000000004"),
                                         ("10 ** 30", str(10 ** 30)), ("1.5e20", "1.5e+20")])
def test_calculate_values(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr, fragment", [("x + 1", "names"), ("abs(-1)", "calls"), ("(1).real", "attribute"),
                                            ("1 / 0", "division by zero"), ("5 % 0", "division by zero"),
                                            ("9**9**9", "too large"), ("10 ** 5000", "too large"),
                                            ("1e308 * 10", "too large"), ("(-8) ** 0.5", "real"),
                                            ("'a' * 3", "numbers"), ("True + 1", "numbers"), ("1 +", "valid"),
                                            ("", "empty"), ("1" * 600, "too long"), ("[1, 2]", "unsupported")])
def test_calculate_refusals(expr, fragment):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=fragment):
        calculate(expr)
    assert time.monotonic() - t0 < 0.5


# --- prompting -------------------------------------------------------------------------------------------------

TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
                  "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                  "{% endfor %}")


def test_tools_prompt_follows_hermes():
    schemas = [tool_schema(add)]
    prompt = render_tools_prompt(schemas)
    assert f"<tools>\n{json.dumps(schemas[0])}\n</tools>" in prompt
    assert "<tool_call>" in prompt and '"name": <function-name>' in prompt and len(prompt) < 800


def test_template_supports_tools(smollm2_tokenizer):
    assert not template_supports_tools(smollm2_tokenizer)  # ChatML: ignores `tools`
    assert not template_supports_tools(char_tokenizer())
    tok = char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    assert template_supports_tools(tok)


def test_render_messages_with_tools(smollm2_tokenizer):
    schemas = [tool_schema(add)]
    prompt = render_tools_prompt(schemas)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    out = render_messages_with_tools(smollm2_tokenizer, messages, schemas)
    assert out[0] == {"role": "system", "content": f"Be brief.\n\n{prompt}"} and out[1] == messages[1]
    assert messages[0]["content"] == "Be brief."  # input untouched
    text = smollm2_tokenizer.apply_chat_template(out, tokenize=False)
    assert "<tools>" in text and "SmolLM" not in text  # our system prompt replaces the default one

    out = render_messages_with_tools(smollm2_tokenizer, messages[1:], schemas)
    assert out == [{"role": "system", "content": prompt}, messages[1]]

    tok = char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    assert render_messages_with_tools(tok, messages, schemas) == messages

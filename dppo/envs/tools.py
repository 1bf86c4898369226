"""Tools for multi-turn agent RL: schemas, parsing a model's tool calls, running them safely, feeding results back.

A tool is a plain Python function (or bound method) with type hints and a Google-style docstring. The pieces:

* `tool_schema(fn)`: its OpenAI/HF JSON schema (built by `transformers.utils.get_json_schema`), or the schema a
  callable carries in its `tool_schema` attribute (a tool defined elsewhere, e.g. an MCP server's: `dppo.envs.mcp`);
* `render_tools_prompt` / `template_supports_tools` / `render_messages_with_tools`: put the schemas in front of
  the model, through the chat template's own `tools=` support or, for templates without it (ChatML, SmolLM2), as
  the Hermes-convention text merged into the system prompt;
* `parse_tool_calls(text)`: the Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of a
  reply, plus one error message per malformed block (to feed back to the model, not to raise);
* `call_tool(tools, call)`: run one call and never raise for anything the tool does (unknown name, arguments that
  do not bind, an exception, a hang: each becomes a `ToolResult` with an `error` kind); `format_tool_message`
  turns the result into the ``{"role": "tool"}`` message of the next turn;
* `calculate(expression)`: the safe arithmetic tool of the `calculator` environment (an `ast` walk, no eval).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dppo.runtime.bounded import bounded_calls

__all__ = ["ToolCall", "ToolResult", "calculate", "call_tool", "format_tool_message", "malformed_result",
           "parse_tool_calls", "render_messages_with_tools", "render_tools_prompt", "template_supports_tools",
           "tool_schema"]


def tool_schema(fn: Callable) -> dict:
    """The OpenAI/HF-style JSON schema of `fn` (``{"type": "function", "function": {...}}``): the dict in its
    `tool_schema` attribute when it carries one (passed through unchanged), else built from its signature and
    docstring.

    Raises ValueError naming the function when its docstring or type hints do not describe every argument, or when
    the schema it carries is not of that form.
    """
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    carried = getattr(fn, "tool_schema", None)
    if carried is not None:
        function = carried.get("function") if isinstance(carried, dict) else None
        if not (carried.get("type") == "function" and isinstance(function, dict) and function.get("name")):
            raise ValueError(f"tool {name}: its tool_schema attribute is not {{'type': 'function', 'function': "
                             f"{{'name': ..., ...}}}}: {carried!r:.200}")
        return carried
    from transformers.utils import get_json_schema  # transformers is heavy: import on first use

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException (plain Exceptions)
        raise ValueError(f"cannot build a tool schema for {name}: {e} (a tool needs a type hint on every "
                         f"argument and a Google-style docstring with a description and an Args: entry for each)") from e


# --- parsing ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its keyword arguments."""
    name: str
    arguments: dict


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _parse_block(body: str) -> ToolCall | str:
    """A `ToolCall` from the JSON between the tags, or the reason it is malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'missing "name" (a non-empty string)'
    args = {} if obj.get("arguments") is None else obj["arguments"]  # missing or null: no arguments
    if isinstance(args, str):  # some models emit the arguments as a JSON string holding the object
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f'"arguments" of {name} is a string but not valid JSON ({e.msg})'
    if not isinstance(args, dict):
        return f'"arguments" of {name} must be a JSON object, got {type(args).__name__}'
    return ToolCall(name.strip(), args)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The Hermes-form tool calls of a reply, in order, and one error message per malformed block.

    Each ``<tool_call>...</tool_call>`` block holds ``{"name": ..., "arguments": {...}}`` ("arguments" may be
    missing, meaning none, or a JSON string holding the object). Text outside the tags is ignored. A block is
    malformed when its JSON is invalid, it has no name, its arguments are not an object, or it is never closed
    (a ``<tool_call>`` followed by another one, or by the end of the text, before its ``</tool_call>``).
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos, index = 0, 0
    while (start := text.find(_OPEN, pos)) != -1:
        index += 1
        body_start = start + len(_OPEN)
        end, reopen = text.find(_CLOSE, body_start), text.find(_OPEN, body_start)
        if end == -1 or (reopen != -1 and reopen < end):
            errors.append(f"tool call {index}: unclosed {_OPEN} (no matching {_CLOSE})")
            if end == -1 and reopen == -1:
                break
            pos = reopen if reopen != -1 else len(text)
            continue
        parsed = _parse_block(text[body_start:end].strip())
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(f"tool call {index}: {parsed}")
        pos = end + len(_CLOSE)
    return calls, errors


# --- prompting -------------------------------------------------------------------------------------------------

def render_tools_prompt(schemas: list[dict]) -> str:
    """The Hermes-convention tools text for the system prompt of a chat template without `tools` support."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>"
            "\n\nFor each function call, return a JSON object with the function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


_PROBE = {"type": "function", "function": {"name": "dppo_probe_tool_x7", "description": "Probe.",
                                           "parameters": {"type": "object", "properties": {}}}}


def template_supports_tools(tokenizer) -> bool:
    """True when the tokenizer's chat template renders `tools=` (a dummy tool changes the text and appears in it)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False)
        with_tools = tokenizer.apply_chat_template(messages, tools=[_PROBE], tokenize=False)
    except Exception:  # no chat template, or one that rejects `tools`
        return False
    return with_tools != plain and _PROBE["function"]["name"] in with_tools


def render_messages_with_tools(tokenizer, messages: list[dict], schemas: list[dict]) -> list[dict]:
    """`messages` ready for `apply_chat_template`: unchanged (a copy) when the template supports tools (pass
    ``tools=schemas`` to it then), else with the tools prompt appended to the first system message, or inserted
    as a new first system message. The input list and its dicts are not modified."""
    out = [dict(m) for m in messages]
    if not schemas or template_supports_tools(tokenizer):
        return out
    prompt = render_tools_prompt(schemas)
    for m in out:
        if m.get("role") == "system":
            content = m.get("content") or ""
            if isinstance(content, list):  # content parts
                m["content"] = [*content, {"type": "text", "text": prompt}]
            else:
                m["content"] = f"{content}\n\n{prompt}" if content else prompt
            return out
    return [{"role": "system", "content": prompt}, *out]


# --- calling ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolResult:
    """What a call produced. `error` is None on success, else one of "unknown_tool", "bad_arguments", "raised",
    "timeout", "malformed"; `content` is then the error message to show the model."""
    content: str
    error: str | None = None
    truncated: bool = False
    timed_out: bool = False


def _to_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str) if isinstance(value, (dict, list)) else str(value)


def _result(content: str, error: str | None, max_chars: int | None, timed_out: bool = False) -> ToolResult:
    if max_chars is not None and len(content) > max_chars:
        more = len(content) - max_chars
        return ToolResult(content[:max_chars] + f"\n[truncated: {more} more characters]", error, True, timed_out)
    return ToolResult(content, error, False, timed_out)


def malformed_result(message: str, *, max_chars: int | None = 1000) -> ToolResult:
    """The result to feed back for a malformed tool-call block (an error message of `parse_tool_calls`)."""
    return _result(f"Error: malformed tool call: {message}", "malformed", max_chars)


def call_tool(tools: Mapping[str, Callable], call: ToolCall, *, max_chars: int | None = 1000,
              timeout_s: float | None = 10.0) -> ToolResult:
    """Run `call` against `tools` (name -> callable); never raises for anything the call or the tool does.

    The tool runs in a daemon thread (`dppo.runtime.bounded.bounded_calls`); after `timeout_s` (None: wait
    forever) the result is a timeout, and the hung thread is abandoned. The content is the
    return value as text (dicts and lists as JSON), cut to `max_chars` with a visible marker.
    """
    if not isinstance(call.name, str) or not isinstance(call.arguments, Mapping):
        return malformed_result(f"name must be a string and arguments an object, got {call!r}", max_chars=max_chars)
    fn = tools.get(call.name)
    if fn is None:
        valid = ", ".join(sorted(tools)) or "(none)"
        return _result(f"Error: unknown tool {call.name!r}; valid tools: {valid}", "unknown_tool", max_chars)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature (some builtins): let the call itself decide
        signature = None
    try:
        if signature is not None:
            signature.bind(**call.arguments)
    except TypeError as e:
        return _result(f"Error: bad arguments for tool {call.name}{signature}: {e}", "bad_arguments", max_chars)

    def run() -> tuple[str, str | None]:
        try:
            return _to_text(fn(**call.arguments)), None
        except BaseException as e:  # noqa: BLE001 - a tool's failure is an answer, not a crash
            return f"Error: {type(e).__name__}: {e}", "raised"

    [outcome] = bounded_calls([run], timeout_s, name="dppo-tool")
    if outcome.status == "timeout":
        return _result(f"Error: tool {call.name} timed out after {timeout_s:g}s", "timeout", max_chars, True)
    content, error = outcome.value  # (run catches everything the tool raises)
    return _result(content, error, max_chars)


def format_tool_message(result: ToolResult) -> dict:
    """The chat message that carries `result` back to the model."""
    return {"role": "tool", "content": result.content}


# --- the calculator tool ---------------------------------------------------------------------------------------

_MAX_CHARS, _MAX_BITS = 500, 4000  # input length; size of any integer along the way (~1200 digits)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large (not finite)")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError("the result is too large")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _checked(node.value)
        raise ValueError(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            if (abs(left).bit_length() - 1) * right > _MAX_BITS:
                raise ValueError("the exponent is too large")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    if isinstance(node, ast.Name):
        raise ValueError(f"names are not allowed: {node.id}")
    if isinstance(node, ast.Call):
        raise ValueError("function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise ValueError("attribute access is not allowed")
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Supports + - * / // % ** and parentheses, unary minus, integers and decimals.

    Args:
        expression: The arithmetic expression to evaluate, e.g. "(3 + 4) * 2 / 7".

    Returns:
        The value as a string: integers exactly, decimals in their shortest form.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expected a non-empty expression")
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is too long (over {_MAX_CHARS} characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not a valid expression: {getattr(e, 'msg', None) or type(e).__name__}") from None
    try:
        value = _eval(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


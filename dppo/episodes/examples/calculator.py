"""The calculator task as an agent written against an OpenAI client: no dppo import, only the standard library.

    dppo train --rollout.episodes agent --agent.name dppo.episodes.examples.calculator:solve --task.name chain_sum ...
    dppo train --preset calculator_agent   # the same, from the preset

`solve(client, example)` asks the model, runs the `calculate` tool it calls (OpenAI `tool_calls`), sends the result
back as a `tool` message, and scores the final answer: 1.0 when its last number is the gold answer. It is the
built-in `calculator` environment's loop written the way an agent author writes it — the same system prompt and
tool schema, so the same warm start serves both (docs/agents.md compares them side by side).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from decimal import Decimal, InvalidOperation

SYSTEM = ("You are a careful assistant. Use the calculate tool to compute the result, then reply with just the "
          "final number.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression.\n\nSupports + - * / // % ** and parentheses, unary minus, "
                   "integers and decimals.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "The arithmetic expression to evaluate, e.g. \"(3 + 4) * 2 / 7\"."}},
        "required": ["expression"]},
    "return": {"type": "string", "description": "The value as a string: integers exactly, decimals in their shortest "
                                                "form."}}}]
MAX_CALLS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_NUMBER = re.compile(r"(?<![\w.)\]])-?\d+(?:,\d{3})*(?:\.\d+)?")


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        if isinstance(node.op, ast.Pow) and abs(_value(node.right)) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("not an arithmetic expression")


def calculate(expression: str) -> str:
    """The tool: an arithmetic expression's value as text (an error message instead of raising)."""
    try:
        value = _value(ast.parse(str(expression).strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"Error: {type(e).__name__}: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def score(reply: str, answer: str) -> float:
    """1.0 when the reply's last number equals the gold answer."""
    numbers = _NUMBER.findall((reply or "").replace("\u2212", "-"))
    try:
        return float(bool(numbers) and Decimal(numbers[-1].replace(",", "")) == Decimal(answer.strip()))
    except InvalidOperation:
        return 0.0


def question(example) -> str:
    prompt = example.prompt
    return prompt if isinstance(prompt, str) else [m for m in prompt if m["role"] == "user"][-1]["content"]


def solve(client, example) -> float:
    """One episode: up to MAX_CALLS model calls; the reward of the final answer (0.0 if none came)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(example)}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return score(message.content, example.answer)
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except (TypeError, json.JSONDecodeError) as e:
                result = f"Error: bad arguments: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0

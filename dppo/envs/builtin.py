"""The built-in environments, each small enough for a 135M model to learn from on a CPU.

- `calculator`: chain-sum questions with more or bigger terms than a small model adds in its head, and a
  `calculate(expression)` tool (`dppo.envs.tools.calculate`, an `ast` evaluator: no eval).
- `python`: the same kind of question with a `python(code)` tool that runs the model's code in the sandbox
  (`dppo.envs.sandbox`: no network, a fresh temp dir, CPU/memory/process/wall limits).
- `feedback`: a retry task without tools: a wrong answer gets "That is not right. Try again."; a right one ends
  the episode with reward `decay ** attempt` (1 on the first try, less on later ones).

The final answer of every built-in is scored like the task's `last_number` reward: the last number of the reply
against the example's gold answer. Each has a `demonstration` (a correct episode), the transcripts `dppo sft`
trains on for the tool format.
"""

from __future__ import annotations

import json
import re

from dppo.envs.base import EnvStep, Environment, ToolEnv
from dppo.envs.sandbox import Limits, describe_layer, detect_layer, run_python
from dppo.envs.tools import ToolCall, calculate, call_tool
from dppo.example import Example, Message
from dppo.rewards.builtin import last_number_match

TOOL_SYSTEM = ("You are a careful assistant. Use the {tool} tool to compute the result, then reply with just the "
               "final number.")


def expression_of(example: Example) -> str:
    """The arithmetic expression of a chain-sum style question (reasoning-gym's metadata, else the text before '=')."""
    entry = example.metadata.get("entry", {}) if isinstance(example.metadata, dict) else {}
    expr = (entry.get("metadata") or {}).get("expression") if isinstance(entry, dict) else None
    if expr:
        return str(expr)
    text = example.prompt if isinstance(example.prompt, str) else example.prompt[-1]["content"]
    found = re.findall(r"[-+*/()\d\s.]+(?==)", text)
    if not found:
        raise ValueError(f"example {example.uid}: no arithmetic expression found in {text!r:.120}")
    return found[-1].strip()


def _question(example: Example) -> str:
    prompt = example.prompt
    return prompt if isinstance(prompt, str) else next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def _tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class CalculatorEnv(ToolEnv):
    """Answer an arithmetic question with the help of a `calculate` tool."""

    tool_name = "calculate"

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.tools = (calculate,)

    def reset(self, example: Example) -> list[Message]:
        self.example = example
        return [{"role": "system", "content": TOOL_SYSTEM.format(tool=self.tool_name)},
                {"role": "user", "content": _question(example)}]

    def score(self, answer: str) -> float:
        return last_number_match(answer, self.example)

    def _call(self, example: Example) -> dict:
        return {"expression": expression_of(example)}

    def demonstration(self, example: Example) -> list[Message]:
        tools = {fn.__name__: fn for fn in self.tools}
        result = call_tool(tools, ToolCall(self.tool_name, self._call(example)), max_chars=self.max_tool_chars)
        return [{"role": "assistant", "content": _tool_call(self.tool_name, self._call(example))},
                {"role": "tool", "content": result.content},
                {"role": "assistant", "content": example.answer}]


class PythonEnv(CalculatorEnv):
    """Answer an arithmetic question with a `python` tool that runs the model's code in the sandbox."""

    tool_name = "python"

    def __init__(self, *, wall_s: float = 5.0, memory_mb: int = 256, sandbox: str = "auto", **options) -> None:
        """sandbox: the isolation layer ("auto" = the strongest isolating one, refused when none can start;
        "bwrap", "unshare", or "rlimits" for limits only, network and filesystem open)."""
        ToolEnv.__init__(self, **{"tool_timeout_s": wall_s + 5.0, **options})
        limits = Limits(wall_s=wall_s, cpu_s=wall_s, memory_mb=memory_mb)
        try:  # the layer must start now, before any model loads: the sandbox fails closed
            self._sandbox_line = describe_layer(sandbox)
        except ValueError as err:
            raise ValueError(f"sandbox: {err}") from None
        layer = detect_layer() if sandbox == "auto" else sandbox  # the layer named at start is the one used

        def python(code: str) -> str:
            """Run a Python program in a sandbox and return what it prints.

            Args:
                code: The Python source code to run; use print() to show results.
            """
            result = run_python(code, limits=limits, layer=layer)
            if result.timed_out:
                raise TimeoutError(f"the program ran longer than {limits.wall_s:g}s and was stopped")
            out = result.stdout if result.exit_code == 0 else (result.stdout + result.stderr)
            return out.strip() or f"(no output; exit code {result.exit_code})"

        self.tools = (python,)

    def start_line(self) -> str:
        """What the trainer prints at start: the sandbox layer in use and, for a weak one, what it does not isolate."""
        return f"[dppo] python tool {self._sandbox_line}"

    def _call(self, example: Example) -> dict:
        return {"code": f"print({expression_of(example)})"}


class FeedbackEnv(Environment):
    """Answer, and after a wrong answer try again; a right answer on attempt j (0-based) earns decay ** j."""

    def __init__(self, *, decay: float = 0.5, retry_message: str = "That is not right. Try again.") -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay: expected in (0, 1], got {decay}")
        self.decay, self.retry_message, self.attempt = decay, retry_message, 0

    def step(self, reply: str) -> EnvStep:
        if last_number_match(reply, self.example) == 1.0:  # right, on some attempt: a success whatever its reward
            return EnvStep(reward=self.decay ** self.attempt, done=True, info={"success": 1.0})
        self.attempt += 1
        return EnvStep(messages=({"role": "user", "content": self.retry_message},))

    def demonstration(self, example: Example) -> list[Message]:
        return [{"role": "assistant", "content": example.answer}]

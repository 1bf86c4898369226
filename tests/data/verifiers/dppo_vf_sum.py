"""A single-turn verifiers v1 taskset written for dppo's tests: "a+b?" tasks scored by the task's own @vf.reward."""

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages if m.role == "assistant"]
        text = content_text(replies[-1].content) if replies else ""
        return 1.0 if self.data.answer in text else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(sum(len(content_text(m.content)) for m in trace.messages if m.role == "assistant"))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 40
    """How many tasks (a + b with a, b in 0..9, in a fixed order)."""
    empty_answers: bool = False
    """Every task's answer is '' (which every reply contains: each episode scores 1; a test of where rewards come from)."""


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        pairs = [(a, b) for a in range(10) for b in range(10)][: self.config.num_tasks]
        return [SumTask(SumData(prompt=f"{a}+{b}?", answer="" if self.config.empty_answers else str(a + b)), self.config.task) for a, b in pairs]


__all__ = ["SumTaskset"]

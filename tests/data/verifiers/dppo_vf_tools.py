"""A tool-using verifiers v1 taskset written for dppo's tests: "a+b?" tasks with an `add` tool served by the task's
own `vf.Toolset` (an MCP server verifiers launches per rollout on its local subprocess runtime); the task's
@vf.reward scores the final reply, a @vf.metric counts the tool calls."""

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AddData(vf.TaskData):
    answer: str


class AddTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config: AddTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages if m.role == "assistant"]
        return 1.0 if replies and self.data.answer in content_text(replies[-1].content) else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(1 for m in trace.messages if m.role == "tool"))


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 20
    task: AddTaskConfig = AddTaskConfig()


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        pairs = [(a, 10 + b) for a in range(10) for b in range(10)][: self.config.num_tasks]
        return [AddTask(AddData(prompt=f"Use the add tool: {a}+{b}?", answer=str(a + b)), self.config.task)
                for a, b in pairs]


__all__ = ["AddTaskset"]


if __name__ == "__main__":  # verifiers launches the tool server as `python -m dppo_vf_tools`
    AddToolset.run()

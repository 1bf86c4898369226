"""The demo's task as a verifiers v1 taskset (benchmarks/bench_verifiers_learning.py): reasoning-gym chain_sum with two
one-digit terms, the very questions and prompts `dppo train --preset demo` trains and evaluates on (its held-out
questions first, then its training questions: load it with dppo's task option `shuffle: false` and `eval_size` =
`held_out`), scored by the demo's own reward (`dppo.tasks.rg.reasoning_gym_score` on the last reply)."""

import functools

import verifiers.v1 as vf
from verifiers.v1.types import content_text


@functools.lru_cache(maxsize=4)
def demo_examples(seed: int) -> tuple:
    """The demo task's held-out examples, then its training examples (dppo.train.presets.demo, task seed `seed`)."""
    from dppo.train.build import build_task
    from dppo.train.config import replace
    from dppo.train.presets import get_preset

    task = build_task(replace(get_preset("demo"), task={"seed": seed}))
    return task.eval + task.train


class ChainSumData(vf.TaskData):
    answer: str
    index: int
    seed: int


class ChainSumTask(vf.Task[ChainSumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        from dppo.tasks.rg import reasoning_gym_score

        replies = [m for m in trace.messages if m.role == "assistant"]
        text = content_text(replies[-1].content) if replies else ""
        return float(reasoning_gym_score(text, demo_examples(self.data.seed)[self.data.index]))


class ChainSumConfig(vf.TasksetConfig):
    seed: int = 0
    """The demo task's seed (its questions and split)."""


class ChainSumTaskset(vf.Taskset[ChainSumTask, ChainSumConfig]):
    def load(self):
        examples = demo_examples(self.config.seed)
        return [ChainSumTask(ChainSumData(prompt=[dict(m) for m in e.prompt], answer=e.answer, index=i,
                                          seed=self.config.seed), self.config.task)
                for i, e in enumerate(examples)]


__all__ = ["ChainSumTaskset"]

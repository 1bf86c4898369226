"""Environments for the episode tests, loaded by file path ("tests/data/scripted_env.py:Scripted") as users' are."""

from dppo.envs import EnvStep, Environment


class Scripted(Environment):
    """`turns` assistant turns: each reply but the last gets a tool message `result <t>`; the last ends the episode
    with reward = the number of digits the model wrote over all its replies (a signal a random model can move)."""

    def __init__(self, turns: int = 3, message: str = "result") -> None:
        self.turns, self.message, self.t, self.digits = turns, message, 0, 0

    def step(self, reply: str) -> EnvStep:
        self.t += 1
        self.digits += sum(c.isdigit() for c in reply)
        if self.t >= self.turns:
            return EnvStep(reward=float(self.digits), done=True)
        return EnvStep(messages=({"role": "tool", "content": f"{self.message} {self.t}"},), info={"tool_calls": 1.0})


class Raises(Scripted):
    def step(self, reply: str) -> EnvStep:
        raise RuntimeError("the environment broke")


class Hangs(Scripted):
    def step(self, reply: str) -> EnvStep:
        import time

        time.sleep(60)


class NotAMessage(Scripted):
    def step(self, reply: str):
        return {"role": "tool"}


class BadReset(Scripted):
    def reset(self, example):
        return "not a list of messages"


class Verdict(Environment):
    """One turn, reward `reward`, and the environment's own verdict `success` in info (None: it gives none)."""

    def __init__(self, reward: float = 0.25, success: bool | None = True) -> None:
        self.reward, self.success = reward, success

    def step(self, reply: str) -> EnvStep:
        return EnvStep(reward=self.reward, done=True, info={} if self.success is None else {"success": self.success})


class EvenAnswer(Environment):
    """One turn; succeeds (verdict and reward 1) exactly when the example's gold answer is even, whatever the reply."""

    def step(self, reply: str) -> EnvStep:
        ok = int(self.example.answer) % 2 == 0
        return EnvStep(reward=float(ok), done=True, info={"success": ok})


class Closes(Scripted):
    """Scripted, counting each instance's close() calls in `closed` (`fail`: "step" raises in step, "reset" in reset)."""

    closed: list = []

    def __init__(self, turns: int = 3, fail: str = "") -> None:
        super().__init__(turns)
        self.fail = fail

    def reset(self, example):
        if self.fail == "reset":
            raise RuntimeError("the reset broke")
        return super().reset(example)

    def step(self, reply: str) -> EnvStep:
        if self.fail == "step":
            raise RuntimeError("the environment broke")
        return super().step(reply)

    def close(self) -> None:
        Closes.closed.append(id(self))

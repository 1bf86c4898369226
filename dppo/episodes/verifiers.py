"""The episode kind `verifiers`: a verifiers v1 taskset's tasks are the run's examples, each played by verifiers' own
harness and client through dppo's recording proxy and scored by the taskset's rewards.

    dppo train --rollout.episodes verifiers --verifiers.taskset my_taskset \\
        --verifiers.options '{"num_tasks": 200}' [--verifiers.harness null] [--verifiers.client eval]

Everything the kind needs is the run config's `verifiers` section (`dppo.episodes.settings.VerifiersSettings`) and
the run's model; nothing is carried inside the examples.

**The examples** (`verifiers_task`, what the trainer's task building asks the kind for): `taskset` is a verifiers
taskset id (an importable module or installed package that exports its `Taskset` subclass in `__all__`, as
`vf eval <id>` takes it) or the path of a local one (`path/to/my_taskset.py` or a package folder, imported from its
parent folder); `options` holds the taskset config's fields (`--env.taskset.*` of `vf eval`), validated by
verifiers' own pydantic model before any model loads. Each task becomes one `Example`: its prompt (the task's
`prompt` after its `system_prompt`, as chat messages; the harness renders the real conversation), its `answer` field
when the task data has one (shown in the samples file; the taskset's rewards score), and its uid
`verifiers:<verifiers' content key>`, by which the player finds the task again. Held out, disjoint by task: the tasks
in a seeded order (`shuffle: false`: the taskset's own order, for a taskset that lists its held-out tasks first), the
first task.eval_size distinct ones to evaluation, the next task.size to training (`dppo.tasks.base.split_distinct`).

**The episodes** (`Player`): verifiers' environment for the taskset (the taskset's own `Env`, `SingleAgentEnv` for a
plain one) with the harness (`harness`: '' = the taskset's own, else verifiers' `null` chat harness) on verifiers'
local `subprocess` runtime (never a cloud default), loaded once per process and held serving (its interception
server, its tool servers) on the proxy's event loop; one verifiers episode per dppo episode:
`Env.run_episode(task, ModelContext)` whose client (`client`: `eval` = `EvalClient`, chat completions; `train` =
`TrainClient`, the token route `/inference/v1/generate`, tokenised by `renderers` with the tokenizer of the run's
model) has this episode's proxy base URL. Every model call of the harness program reaches the proxy, which records
its tokens, µ and µ's top-K (the rows are joined as for any agent, `dppo.episodes.agent_loop`).

The reward is the taskset's: the mean over the episode's trainable traces of `Trace.reward` (the weighted sum of
the task's `@vf.reward` functions, and what the env's `finalize` recorded across agents). An episode verifiers
marks failed (a harness error, a failed call, a timeout) raises here with verifiers' message: the agent loop ends
it with reward 0, counted and named in the samples file, and the run goes on. verifiers 0.4.0's tasks define no
group-level reward hook; a multi-agent env's cross-agent judgement (`Env.finalize`) is what scores across traces.

The harness program runs as a process of the trainer's user: verifiers prepares it with `uv` (installing `uv` for
the user and the program's own dependencies from PyPI on first use, cached after). Harnesses that execute the
model's commands (`bash` and the code agents) run them on this machine too: verifiers warns, and so does dppo's
docs (docs/agents.md); the model's code belongs in a sandbox runtime there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dppo.runtime.models import load_tokenizer
from dppo.tasks.base import Example, Task, chat_prompt, split_distinct

CLIENTS = ("eval", "train")
"""verifiers' clients: `eval` (OpenAI chat completions) and `train` (vLLM's `/inference/v1/generate`, tokens)."""

KEY_VARIABLE = "DPPO_PROXY_KEY"
"""The environment variable verifiers' client reads the proxy's key from (`api_key_var`)."""

_SERVING: dict[tuple, tuple] = {}
"""(event loop, taskset, options, harness) -> (the serving Env, its exit stack): one per process and loop."""


def is_local(value: str) -> bool:
    """Whether a taskset or harness names a local file or folder (has a '/' or ends in .py) rather than an id."""
    return "/" in value or value.endswith(".py")


def taskset_module(taskset: str, field: str = "verifiers.taskset") -> str:
    """The module name verifiers imports for `taskset`: an id as is, or a local file / package folder, whose parent
    folder goes on sys.path and PYTHONPATH (for verifiers' local tool-server processes); ValueError naming `field`
    when it does not exist."""
    if not is_local(taskset):
        return taskset
    path = Path(taskset).expanduser().resolve()
    if not path.exists():
        kind = field.rsplit(".", 1)[-1]
        raise ValueError(f"{field}: {taskset!r} does not exist (a {kind} id, a .py file or a package folder)")
    parent = str(path.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    # verifiers' local processes (a taskset's tool servers) import it by name too
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parent not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([parent, *paths])
    return path.stem if path.suffix == ".py" else path.name


@functools.lru_cache(maxsize=8)
def load_tasks(taskset: str, options: str = "{}") -> tuple:
    """The taskset's tasks, in `load()` order (cached per process: the player looks its task up by key); `options`:
    the taskset config's fields as a JSON object."""
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    module = taskset_module(taskset)
    try:
        config = taskset_config_type(module).model_validate({**json.loads(options), "id": module})
        loaded = load_taskset(config)
    except ModuleNotFoundError as err:
        raise ValueError(f"verifiers.taskset: {err}") from err
    except Exception as err:  # pydantic's ValidationError, verifiers' own checks: the field is named in the text
        raise ValueError(f"verifiers.options: taskset {taskset!r}: {err}") from err
    if not loaded.bounded:
        raise ValueError(f"verifiers.taskset: {taskset!r} is infinite; bound it in its config (verifiers.options)")
    return tuple(loaded)


@functools.lru_cache(maxsize=8)
def tasks_by_uid(taskset: str, options: str = "{}") -> dict:
    """The taskset's tasks by the uid of their example (`verifiers:<key>`; tasks of one key are the same task)."""
    return {f"verifiers:{t.key}": t for t in load_tasks(taskset, options)}


def _prompt(data) -> tuple:
    prompt = data.prompt
    if prompt is None:
        return chat_prompt("", data.system_prompt)
    if isinstance(prompt, str):
        return chat_prompt(prompt, data.system_prompt)
    messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    system = ({"role": "system", "content": data.system_prompt},) if data.system_prompt else ()
    return system + tuple(messages)


def verifiers_task(settings, *, size: int, eval_size: int, seed: int) -> Task:
    """The examples of the `verifiers` section's taskset (`settings`: `VerifiersSettings`), split by the run's
    task.size, task.eval_size and task.seed (module docstring); the taskset and harness checked here, before any
    model loads."""
    if not settings.taskset:
        raise ValueError("verifiers.taskset: rollout.episodes verifiers needs a taskset (an installed taskset id, or "
                         "a local .py file or package folder)")
    if settings.harness:
        check_harness(settings.harness)
    tasks = load_tasks(settings.taskset, settings.options)
    order = list(range(len(tasks)))
    if settings.shuffle:
        random.Random(seed).shuffle(order)

    def example(i: int) -> Example:
        data = tasks[i].data
        answer = getattr(data, "answer", None)
        return Example(prompt=_prompt(data), answer="" if answer is None else str(answer),
                       uid=f"verifiers:{tasks[i].key}")

    train, held_out = split_distinct((example(i) for i in order), size=size, eval_size=eval_size,
                                     task=f"verifiers:{settings.taskset}")
    return Task(name="verifiers", train=train, eval=held_out, reward=_scored_by_the_taskset)


def check_harness(harness: str) -> None:
    """ValueError naming verifiers.harness unless it names a verifiers harness (a built-in such as `null` or
    `bash`, a module exporting a `Harness`, or a local file / package of one)."""
    from verifiers.v1.utils.loaders import harness_class

    module = taskset_module(harness, field="verifiers.harness")
    try:
        harness_class(module)
    except Exception as err:  # ModuleNotFoundError, verifiers' "no Harness exported"
        raise ValueError(f"verifiers.harness: {harness!r}: {err}") from err


def _scored_by_the_taskset(completion: str, example: Example) -> float:
    raise ValueError("rollout.episodes verifiers: the taskset's own rewards score its episodes, not a task reward")


def env_config(settings):
    """verifiers' environment config for the `verifiers` section: the taskset and its config, the harness (the
    taskset's own when it ships one, else verifiers' `null` chat harness), the local subprocess runtime."""
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    module = taskset_module(settings.taskset)
    harness = taskset_module(settings.harness, "verifiers.harness") if settings.harness else default_harness_id(module)
    harness = "null" if harness == "bash" and not settings.harness else harness
    return env_config_type(module).model_validate({
        "taskset": {**json.loads(settings.options), "id": module},
        **{seat: {"harness": {"id": harness}, "runtime": {"type": "subprocess"}} for seat in _seats(module)}})


def _seats(module: str) -> list[str]:
    """The agent seats of the taskset's env (`agent` for a plain one)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    fields = env_config_type(module).model_fields
    return [name for name, f in fields.items() if isinstance(f.default, AgentConfig)] or ["agent"]


async def _env(settings):
    """The serving environment of the `verifiers` section on the running loop (built and entered on first use)."""
    from verifiers.v1.utils.loaders import load_environment

    key = (asyncio.get_running_loop(), settings.taskset, settings.options, settings.harness)
    if key not in _SERVING:
        env = load_environment(env_config(settings))
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(env.serving())
        _SERVING[key] = (env, stack)
    return _SERVING[key][0]


async def close_all() -> None:
    """Leave every serving environment of the running loop (interception and tool servers stop)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _SERVING if k[0] is loop]:
        _, stack = _SERVING.pop(key)
        await stack.aclose()


def _tokenizer_dir(name: str) -> str:
    """A folder `renderers` can load the run's tokenizer from (dppo's loader: a model name, a GGUF, a folder)."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer_config.json").exists():
        return str(path)
    target = Path(tempfile.gettempdir()) / "dppo-tokenizers" / name.replace("/", "--")
    if not (target / "tokenizer_config.json").exists():
        load_tokenizer(name).save_pretrained(str(target))
    return str(target)


def client_config(client: str, tokenizer: str, base_url: str):
    """verifiers' client config for one episode: its proxy base URL, the key from KEY_VARIABLE (`train`: prompts
    rendered to token ids with `tokenizer`, the run's model)."""
    import verifiers.v1 as vf

    if client == "train":
        return vf.TrainClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE,
                                    renderer_model_name=_tokenizer_dir(tokenizer))
    return vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE)


def episode_reward(episode) -> float:
    """The mean reward of a verifiers episode's trainable traces; RuntimeError with verifiers' message when the
    episode failed."""
    failed = [e for t in episode.traces for e in t.errors] + list(episode.errors)
    if failed or not episode.ok:
        error = failed[-1] if failed else None
        raise RuntimeError(f"verifiers episode failed: {error.type}: {error.message}"[:1500] if error
                           else "verifiers episode failed")
    rewards = [t.reward for t in episode.traces if t.agent.trainable]
    if not rewards:
        raise RuntimeError("verifiers episode has no trainable trace")
    return sum(rewards) / len(rewards)


@dataclass(frozen=True)
class Player:
    """What plays the verifiers episodes (picklable: rollout workers receive it inside the episodes): the `verifiers`
    section and the run's model, whose tokenizer the `train` client renders with (module docstring)."""

    settings: Any
    """The run config's `verifiers` section (`dppo.episodes.settings.VerifiersSettings`)."""
    tokenizer: str
    """The run's model (model.name): `TrainClient` renders prompts with its tokenizer."""

    @property
    def label(self) -> str:
        """How the run's messages name it (an episode's error: "agent 'verifiers my_sums.py': ...")."""
        return f"verifiers {self.settings.taskset}"

    def start_line(self, host: str) -> str:
        s = self.settings
        return (f"[dppo] verifiers taskset {s.taskset!r} (harness {s.harness or 'its own'}, client {s.client}) "
                f"through the OpenAI-compatible proxy on {host} (a base URL per episode); each episode a harness "
                f"process with this process's rights")

    async def play(self, client, example):
        """verifiers' `Episode` of the example's task, played through the proxy `client` points at."""
        import verifiers.v1 as vf

        s = self.settings
        task = tasks_by_uid(s.taskset, s.options).get(example.uid)
        if task is None:
            raise ValueError(f"verifiers: example {example.uid!r} is no task of taskset {s.taskset!r}")
        os.environ[KEY_VARIABLE] = str(client.api_key)  # (one key per run: every episode sets the same value)
        env = await _env(s)
        ctx = vf.ModelContext(model="policy",
                              client=client_config(s.client, self.tokenizer, str(client.base_url).rstrip("/")))
        return await env.run_episode(task, ctx)

    def agent(self):
        """The agent function the agent loop runs for each episode: `agent(client, example) -> reward`; its `close`
        leaves the serving environments on the proxy's loop when the run ends."""
        async def verifiers_agent(client, example) -> float:
            return episode_reward(await self.play(client, example))

        verifiers_agent.close = close_all
        return verifiers_agent


__all__ = ["CLIENTS", "KEY_VARIABLE", "Player", "check_harness", "client_config", "close_all", "env_config",
           "episode_reward", "is_local", "load_tasks", "taskset_module", "verifiers_task"]

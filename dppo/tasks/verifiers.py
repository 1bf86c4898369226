"""A verifiers v1 taskset as a dppo task: its tasks become the run's examples (a held-out split of them too).

    dppo train --rollout.episodes agent --agent.name verifiers \\
        --task.name verifiers --task.options '{"taskset": "my_taskset", "config": {"num_tasks": 200}}'

`taskset` is a verifiers taskset id (an importable module or installed package that exports its `Taskset` subclass in
`__all__`, as `vf eval <id>` takes it) or the path of a local one (`path/to/my_taskset.py` or a package folder,
imported from its parent folder). `config` holds the taskset config's fields (`--env.taskset.*` of `vf eval`),
validated by verifiers' own pydantic model before any model loads.

Each task becomes one `Example`: its prompt (the task's `prompt` after its `system_prompt`, as chat messages; the
harness renders the real conversation), its `answer` field when the task data has one (shown in the samples file;
the taskset's rewards score), and in `metadata["verifiers"]` what the agent needs to play it again: the taskset,
its config, the task's index, and the run's choice of verifiers harness (`harness`, '' = the taskset's own, else
verifiers' `null` chat harness) and client (`client`: `eval` = chat completions, `train` = the token route through
`renderers`, which tokenises with `tokenizer`). The agent `verifiers` (`dppo.episodes.verifiers`) plays them.

Held out, disjoint by task: the tasks in a seeded order (`shuffle: false`: the taskset's own order, for a taskset that
lists its held-out tasks first), the first `eval_size` distinct ones (by verifiers' content key) to evaluation, the
next `size` to training (`dppo.tasks.base.split_distinct`).
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from dppo.tasks.base import Example, Task, chat_prompt, split_distinct

CLIENTS = ("eval", "train")
"""verifiers' clients: `eval` (OpenAI chat completions) and `train` (vLLM's `/inference/v1/generate`, tokens)."""


def taskset_module(taskset: str, field: str = "taskset") -> str:
    """The module name verifiers imports for `taskset`: an id as is, or a local file / package folder, whose parent
    folder goes on sys.path and PYTHONPATH (for verifiers' local tool-server processes); ValueError naming it when
    it does not exist."""
    if "/" not in taskset and not taskset.endswith(".py"):
        return taskset
    path = Path(taskset).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"task.options.{field}: {taskset!r} does not exist (a {field} id, a .py file or a package "
                         f"folder)")
    parent = str(path.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    # verifiers' local processes (a taskset's tool servers) import it by name too
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parent not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([parent, *paths])
    return path.stem if path.suffix == ".py" else path.name


@functools.lru_cache(maxsize=8)
def load_tasks(taskset: str, config_json: str = "{}") -> tuple:
    """The taskset's tasks, in `load()` order (cached per process: the agent looks its task up by index)."""
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    module = taskset_module(taskset)
    try:
        config = taskset_config_type(module).model_validate({**json.loads(config_json), "id": module})
        loaded = load_taskset(config)
    except ModuleNotFoundError as err:
        raise ValueError(f"task.options.taskset: {err}") from err
    except Exception as err:  # pydantic's ValidationError, verifiers' own checks: the field is named in the text
        raise ValueError(f"task.options.config: taskset {taskset!r}: {err}") from err
    if not loaded.bounded:
        raise ValueError(f"task.options.taskset: {taskset!r} is infinite; bound it in its config")
    return tuple(loaded)


def _prompt(data) -> tuple:
    prompt = data.prompt
    if prompt is None:
        return chat_prompt("", data.system_prompt)
    if isinstance(prompt, str):
        return chat_prompt(prompt, data.system_prompt)
    messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    system = ({"role": "system", "content": data.system_prompt},) if data.system_prompt else ()
    return system + tuple(messages)


def verifiers_task(taskset: str = "", config: dict[str, Any] | None = None, harness: str = "", client: str = "eval",
                   tokenizer: str = "", size: int = 1000, eval_size: int = 0, seed: int = 0,
                   shuffle: bool = True) -> Task:
    """The examples of a verifiers taskset (module docstring); options checked here, before any model loads."""
    if not taskset:
        raise ValueError('task.options.taskset: the verifiers taskset to train, e.g. {"taskset": "my_taskset"}')
    if client not in CLIENTS:
        raise ValueError(f"task.options.client: expected one of {CLIENTS}, got {client!r}")
    if client == "train" and not tokenizer:
        raise ValueError("task.options.tokenizer: the train client renders prompts to token ids itself: name the "
                         "run's tokenizer (model.name, a folder or a hub id cached here)")
    if not isinstance(config, (dict, type(None))):
        raise ValueError(f"task.options.config: expected a JSON object, got {config!r}")
    if harness:
        _check_harness(harness)
    config_json = json.dumps(config or {}, sort_keys=True)
    tasks = load_tasks(taskset, config_json)
    order = list(range(len(tasks)))
    if shuffle:
        random.Random(seed).shuffle(order)
    spec = {"taskset": taskset, "config": config or {}, "harness": harness, "client": client, "tokenizer": tokenizer}

    def example(i: int) -> Example:
        data = tasks[i].data
        answer = getattr(data, "answer", None)
        return Example(prompt=_prompt(data), answer="" if answer is None else str(answer),
                       metadata={"verifiers": {**spec, "idx": i}}, uid=f"verifiers:{tasks[i].key}")

    train, held_out = split_distinct((example(i) for i in order), size=size, eval_size=eval_size,
                                     task=f"verifiers:{taskset}")
    return Task(name="verifiers", train=train, eval=held_out, reward=_scored_by_the_agent)


def _check_harness(harness: str) -> None:
    """ValueError naming task.options.harness unless it names a verifiers harness (a built-in such as `null` or
    `bash`, a module exporting a `Harness`, or a local file / package of one)."""
    from verifiers.v1.utils.loaders import harness_class

    module = taskset_module(harness, field="harness")
    try:
        harness_class(module)
    except Exception as err:  # ModuleNotFoundError, verifiers' "no Harness exported"
        raise ValueError(f"task.options.harness: {harness!r}: {err}") from err


def _scored_by_the_agent(completion: str, example: Example) -> float:
    raise ValueError("task 'verifiers': the taskset's own rewards score its episodes; run it with "
                     "--rollout.episodes agent --agent.name verifiers")


__all__ = ["CLIENTS", "load_tasks", "taskset_module", "verifiers_task"]

"""The agent `verifiers`: a verifiers v1 taskset's task played by verifiers' own harness and client through the proxy.

    dppo train --rollout.episodes agent --agent.name verifiers --task.name verifiers \\
        --task.options '{"taskset": "my_taskset", "harness": "null", "client": "eval"}'

Each episode's example comes from `dppo.tasks.verifiers` (its `metadata["verifiers"]` names the taskset, its config,
the task's index, the harness and the client). The agent loads verifiers' environment for that taskset once per
process (the taskset's own `Env`, `SingleAgentEnv` for a plain one) with the harness on verifiers' local
`subprocess` runtime (never a cloud default), holds it serving (its interception server, its tool servers) on the
proxy's event loop, and runs one verifiers episode per dppo episode: `Env.run_episode(task, ModelContext)` whose
client (`EvalClient`: chat completions, or `TrainClient`: the token route `/inference/v1/generate`, tokenised by
`renderers` with the run's tokenizer) has this episode's proxy base URL. Every model call of the harness program
reaches the proxy, which records its tokens, µ and µ's top-K (the rows are joined as for any agent).

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
import json
import os
import tempfile
from pathlib import Path

from dppo.runtime.models import load_tokenizer
from dppo.tasks.verifiers import load_tasks, taskset_module

KEY_VARIABLE = "DPPO_PROXY_KEY"
"""The environment variable verifiers' client reads the proxy's key from (`api_key_var`)."""

_SERVING: dict[tuple, tuple] = {}
"""(event loop, taskset, config, harness) -> (the serving Env, its exit stack): one per process and loop."""


def env_config(spec: dict):
    """verifiers' environment config for an example's spec: the taskset and its config, the harness (the taskset's
    own when it ships one, else verifiers' `null` chat harness), the local subprocess runtime."""
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    module = taskset_module(spec["taskset"])
    harness = taskset_module(spec["harness"]) if spec.get("harness") else default_harness_id(module)
    harness = "null" if harness == "bash" and not spec.get("harness") else harness
    return env_config_type(module).model_validate({
        "taskset": {**spec.get("config", {}), "id": module},
        **{seat: {"harness": {"id": harness}, "runtime": {"type": "subprocess"}} for seat in _seats(module)}})


def _seats(module: str) -> list[str]:
    """The agent seats of the taskset's env (`agent` for a plain one)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    fields = env_config_type(module).model_fields
    return [name for name, f in fields.items() if isinstance(f.default, AgentConfig)] or ["agent"]


async def _env(spec: dict):
    """The serving environment of `spec` on the running loop (built and entered on first use)."""
    from verifiers.v1.utils.loaders import load_environment

    key = (asyncio.get_running_loop(), spec["taskset"], json.dumps(spec.get("config", {}), sort_keys=True),
           spec.get("harness", ""))
    if key not in _SERVING:
        env = load_environment(env_config(spec))
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


def client_config(spec: dict, base_url: str):
    """verifiers' client config for one episode: its proxy base URL, the key from KEY_VARIABLE."""
    import verifiers.v1 as vf

    if spec.get("client", "eval") == "train":
        return vf.TrainClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE,
                                    renderer_model_name=_tokenizer_dir(spec["tokenizer"]))
    return vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE)


async def play(client, example):
    """verifiers' `Episode` of the example's task, played through the proxy `client` points at (module doc)."""
    import verifiers.v1 as vf

    spec = example.metadata.get("verifiers") if isinstance(example.metadata, dict) else None
    if not spec:
        raise ValueError("agent 'verifiers' plays the examples of --task.name verifiers (this example has no "
                         "metadata['verifiers'])")
    os.environ[KEY_VARIABLE] = str(client.api_key)  # (one key per run: every episode sets the same value)
    env = await _env(spec)
    task = load_tasks(spec["taskset"], json.dumps(spec.get("config", {}), sort_keys=True))[spec["idx"]]
    ctx = vf.ModelContext(model="policy", client=client_config(spec, str(client.base_url).rstrip("/")))
    return await env.run_episode(task, ctx)


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


async def agent(client, example) -> float:
    """One episode of the example's verifiers task through the proxy `client` points at; its reward (module doc)."""
    return episode_reward(await play(client, example))


agent.close = close_all  # the agent loop leaves the serving environments on the proxy's loop when the run ends


__all__ = ["KEY_VARIABLE", "agent", "client_config", "close_all", "env_config", "episode_reward", "play"]

"""The fields a config.yaml written by an older dppo holds that now live elsewhere: such a file is refused before any
model loads, naming each moved field and its new place (no silent migration: the user edits the file once, as the
message says, and `--resume` goes on)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from dppo._checks import ConfigError
from dppo.episodes.settings import ProxySettings
from dppo.train.engine_flags import with_flags
from dppo.train.rollout_config import RolloutConfig


MOVED = {
    "model.autocast_bf16": "model.precision (true: bf16, false: fp32)",
    "model.tiny_hidden": "model.name (tiny-random-HxL: hidden size H, L layers; tiny-random = tiny-random-64x2)",
    "model.tiny_layers": "model.name (tiny-random-HxL: hidden size H, L layers; tiny-random = tiny-random-64x2)",
    "optim.beta1": "optim.betas (β1 β2)",
    "optim.beta2": "optim.betas (β1 β2)",
    "log.tensorboard": "log.report_to (false: none, or the other trackers)",
    "advantage.eps": "nothing: a standard deviation is divided with dppo.advantages.STD_EPS (1e-6) added; delete it",
    "rollout.hf_max_batch_rows": "rollout.hf.max_batch_rows",
    "rollout.fp8_activations": "rollout.hf.fp8_activations",
    "rollout.vllm_kv_cache_gb": "rollout.vllm.kv_cache_gb (engine vllm) or rollout.vllm_server.kv_cache_gb "
                                "(engine vllm-server)",
    "rollout.vllm_gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "rollout.servers": "rollout.vllm_server.servers",
    "rollout.server_urls": "rollout.vllm_server.urls",
    "rollout.server_partial": "rollout.vllm_server.partial",
    "rollout.server_timeout_s": "rollout.vllm_server.timeout_s",
    "rollout.server_args": "rollout.vllm_server.args",
    "rollout.server_weights_dir": "rollout.vllm_server.weights_dir",
    "rollout.lora_sync": "rollout.vllm_server.lora_sync",
    **{f"{kind}.{f.name}": f"proxy.{f.name}" for kind in ("agent", "verifiers") for f in fields(ProxySettings)},
}
"""Fields of a config.yaml written by an older dppo -> where each lives now (issue 48: each engine's settings in its
own node; issue 61: the recording proxy's settings, once in both the agent and the verifiers section, in one `proxy`
section). Such a file is refused before any model loads, naming every moved field and its new place; the command
line's flags of the same fields too (`check_moved_flags`)."""


MOVED_VALUES = {
    ("task", "name", "verifiers"):
        "rollout.episodes verifiers with the taskset in verifiers.taskset (task.options' taskset, config, harness, "
        "client and shuffle are verifiers.taskset, verifiers.options, verifiers.harness, verifiers.client and "
        "verifiers.shuffle; its tokenizer is the run's model's; size, eval_size and seed stay in task)",
    ("agent", "name", "verifiers"):
        "rollout.episodes verifiers (agent.max_calls, max_tokens, timeout_s and concurrency are proxy.*)",
}
"""Values of an older dppo that chose what is now another field (issue 61: a verifiers taskset, once a task and an
agent named together, is the episode kind `verifiers` with its own section) -> the new spelling."""


def moved_values(get) -> list[str]:
    """"X v is now Y" for each `MOVED_VALUES` entry whose field holds its old value (`get(section, field)`)."""
    return [f"{section}.{name} {value} is now {new}" for (section, name, value), new in MOVED_VALUES.items()
            if get(section, name) == value]


def check_moved_values(get, source: str) -> None:
    """ConfigError naming the first field of `MOVED_VALUES` that holds its old value, with every new spelling."""
    found = moved_values(get)
    if found:
        raise ConfigError(f"{found[0].split()[0]}: {source} spells what an older dppo did; " + "; ".join(found))


def check_moved(data: dict[str, Any], source: str) -> None:
    """ConfigError naming each field of `data` that moved (`MOVED`, `MOVED_VALUES`) and its new place."""
    found = [_moved(old, new) for old, new in MOVED.items() if old.split(".")[1] in (data.get(old.split(".")[0]) or {})]
    found += moved_values(lambda section, name: (data.get(section) or {}).get(name))
    rollout = data.get("rollout") or {}
    for kind in ("env", "agent"):  # the episode kind was which of the two sections named something
        if "episodes" not in rollout and (data.get(kind) or {}).get("name"):
            found.append(f"{kind}.name chooses nothing now: the episode kind is rollout.episodes ({kind})")
    if "episodes" not in rollout and (data.get("agent") or {}).get("name") and "max_tokens" in (data.get("env") or {}):
        found.append("env.max_tokens (an agent's row) is now proxy.max_tokens")
    found += _moved_engine_fields(rollout)
    if found:
        raise ConfigError(f"{found[0].split()[0]}: {source} was written by an older dppo; edit it: "
                          + "; ".join(found))


ENGINE_FIELDS = ("engine", "dtype", "quantization", "fleet", "engine_lag", "hf", "vllm", "vllm_server")
"""The rollout fields of an older dppo that chose the engines: a config file lists its engines now (rollout.engines;
the command line keeps them as flags, `dppo.train.engine_flags`)."""


def _moved_engine_fields(rollout: dict[str, Any]) -> list[str]:
    """The line naming the old engine fields of a config file's rollout section and the list they spell."""
    old = [name for name in ENGINE_FIELDS if name in rollout]
    if not old:
        return []
    names = ", ".join(f"rollout.{name}" for name in old)
    try:
        given = {k: rollout[k] for k in old if rollout[k] is not None}
        engines = with_flags(RolloutConfig(), given).engines
        spelled = "[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in n.to_dict().items()) + "}"
                                  for n in engines) + "]"
        return [f"{names} are now rollout.engines, a list of engines: engines: {spelled}"]
    except (ValueError, TypeError):  # (the old values were invalid too: name the new shape)
        return [f"{names} are now rollout.engines, a list of engines, each {{kind, dtype, fp8, lag, its kind's "
                f"settings}}"]


def _moved(old: str, new: str) -> str:
    """"X is now Y", or "X is gone: why" for a field with no new place (MOVED's "nothing: ...")."""
    return f"{old} is gone: {new.removeprefix('nothing: ')}" if new.startswith("nothing") else f"{old} is now {new}"


def check_moved_flags(args: list[str]) -> None:
    """ConfigError naming each command-line flag of an older dppo (`--rollout.server-urls`, a `MOVED` field) and the
    flag that replaced it, before the parser's generic "unrecognized option"."""
    flags = {}
    for old, new in MOVED.items():
        section, name = old.split(".", 1)
        for spelled in (name, f"no_{name}"):  # (a boolean's --x.no-y too)
            flags[f"--{section}.{spelled.replace('_', '-')}"] = new
    found = []
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in flags and flags[flag].startswith("nothing"):
            found.append(f"{flag} is gone: {flags[flag].removeprefix('nothing: ')}")
        elif flag in flags:
            field, _, rest = flags[flag].partition(" ")  # "rollout.vllm_server.urls", "(engine vllm) or ..."
            found.append(f"{flag} is now --{field.replace('_', '-')}" + (f" {rest}" if rest else ""))
    given = {(section, name): flag_value(args, f"--{section}.{name}") for section, name, _ in MOVED_VALUES}
    found += [f"--{moved.replace(' is now ', ' is now --', 1)}" for moved in moved_values(lambda *key: given[key])]
    if found:
        raise ConfigError(f"{found[0].split()[0]}: a flag of an older dppo; " + "; ".join(found))


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value of `flag` in `args` (`--flag value` or `--flag=value`), None when absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value

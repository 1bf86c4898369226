"""The `openenv` environment (`dppo.envs.openenv`) against a real OpenEnv server: the guess-the-number game of
tests/envs/openenv_game.py, written with openenv's own server classes, served by dppo (`app`, in this process) or by
uvicorn in a process of its own (`base_url`). Checked: reset/step map to OpenEnv's reset/step and observations,
rewards summed or last, reset_keys, malformed actions answered not raised, options refused naming the field, an
unreachable server refused before any model loads, each episode's session closed however it ends, a server that dies
mid-episode contained as an env error, and 2 trainer steps end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("openenv", reason="the openenv package is not installed")

from conftest import free_port, smoke_config  # noqa: E402
from dppo.envs import ENVIRONMENTS, make_environment  # noqa: E402
from dppo.envs.openenv import OpenEnvEnv  # noqa: E402
from dppo.episodes.env_loop import EnvCollector  # noqa: E402
from dppo.episodes.settings import EnvSettings  # noqa: E402
from dppo.example import Example  # noqa: E402
from dppo.rollout.base import SamplingParams  # noqa: E402
from dppo.rollout.hf import HFEngine  # noqa: E402

HERE = Path(__file__).resolve().parent
APP = f"{HERE / 'openenv_game.py'}:app"
EXAMPLE = Example(prompt=({"role": "user", "content": "2+3?"},), answer="5", metadata={"seed": 7, "level": 2})
GAME = {"app": APP, "reset_keys": {"target": "answer"}, "observation_key": "message"}


def _sessions(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/sessions", timeout=5) as answer:
        return json.loads(answer.read())


def _uvicorn() -> tuple[subprocess.Popen, int]:
    """The game served by uvicorn in a process of its own, once it answers /schema, and its port (another port is
    tried when the free one found was taken meanwhile)."""
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "openenv_game:app", "--port",
                                 str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/schema", timeout=1).close()
                return proc, port
            except OSError:
                time.sleep(0.1)
        proc.kill()
        error = proc.communicate()[1].decode()[-2000:]
    raise AssertionError(f"the game's server did not start: {error}")


@pytest.fixture(scope="module")
def game():
    """A factory of the game served by dppo in this process (`app`), the target the example's answer."""
    return make_environment("openenv", **GAME)


@pytest.fixture(scope="module")
def model(tiny_model, with_logit_bias):
    """The tiny model, never sampling pad / <|im_start|> / unk, stopping often (short, readable replies)."""
    return with_logit_bias(tiny_model, {0: -40.0, 2: -40.0, 3: -40.0, 1: 2.0})


def _collect(model, tokenizer, options: dict, n: int = 2, **limits):
    settings = EnvSettings("openenv", json.dumps(options), **{"max_turns": 3, "max_tokens": 120, **limits})
    params = SamplingParams(n=n, max_new_tokens=6, top_k_logprobs=2, stop_token_ids=(1,), seed=3)
    return EnvCollector(settings)(HFEngine(model, tokenizer), [EXAMPLE], params)


def test_reset_and_step_are_openenvs_and_observations_become_messages(game):
    env = game()
    try:
        messages = env.reset(EXAMPLE)
        assert [m["role"] for m in messages] == ["system", "user"]
        assert messages[1]["content"] == "Guess the number from 0 to 9."
        assert '"guess"' in messages[0]["content"] and '"required": ["guess"]' in messages[0]["content"]
        assert "metadata" not in messages[0]["content"]  # (OpenEnv's own field, not the game's)
        step = env.step('I think {"guess": "3"}')
        assert step.messages == ({"role": "user", "content": "higher"},) and not step.done
        assert env.step('```json\n{"guess": "9"}\n```').messages[0]["content"] == "lower"
        last = env.step('{"guess": "5"}')
        assert last.done and last.messages == () and last.reward == 1.0
    finally:
        env.close()
    whole = make_environment("openenv", app=APP, system_prompt="Play.", show_schema=False, reset_args={"target": 5})()
    try:  # no observation_key: the observation's fields as JSON; no schema: the system prompt alone
        assert whole.reset(EXAMPLE)[0] == {"role": "system", "content": "Play."}
        assert json.loads(whole.step('{"guess": "1"}').messages[0]["content"])["attempts"] == 1
    finally:
        whole.close()


@pytest.mark.parametrize("reward, expected", [("sum", [0.1, 0.1, 1.0]), ("last", [0.1, 0.0, 0.9])])
def test_rewards_are_summed_or_the_last(reward, expected):
    env = make_environment("openenv", **GAME, reward=reward, reset_args={"max_attempts": 5})()
    try:
        env.reset(EXAMPLE)
        steps = [env.step(json.dumps({"guess": g})) for g in ("1", "9", "5")]
    finally:
        env.close()
    assert [s.reward for s in steps] == pytest.approx(expected) and steps[-1].done
    assert sum(s.reward for s in steps) == pytest.approx({"sum": 1.2, "last": 1.0}[reward])


def test_reset_keys_take_example_fields_or_metadata_and_reset_args_are_fixed():
    import random

    env = make_environment("openenv", app=APP, reset_keys=["seed"], reset_args={"max_attempts": 1},
                           action_key="guess")()
    try:
        env.reset(EXAMPLE)  # seed from the example's metadata: the game's target is Random(7)'s
        target = random.Random(7).randint(0, 9)
        step = env.step(str((target + 1) % 10))
        assert step.done and step.reward == pytest.approx(0.1)  # max_attempts 1: the first wrong guess ends it
        with pytest.raises(ValueError, match=r"reset_keys: example .* has no field or metadata key 'nope'"):
            make_environment("openenv", app=APP, reset_keys=["nope"])().reset(EXAMPLE)
    finally:
        env.close()


def test_a_malformed_action_gets_an_error_observation_and_the_episode_goes_on(game):
    env = game()
    try:
        env.reset(EXAMPLE)
        for reply, why in [("five", "holds no JSON object"), ('{"guess": 5}', "field 'guess': expected string"),
                           ('{"guess": "5", "hint": 1}', "unknown field(s) ['hint']"),
                           ("{}", "missing field(s) ['guess']"),
                           (json.dumps({"guess": "5" * 41}), "the environment refused the action")]:
            step = env.step(reply)
            assert not step.done and step.reward == 0.0 and step.info == {"tool_errors": 1.0}
            assert step.messages[0]["role"] == "user" and why in step.messages[0]["content"], step.messages
        assert env.step('{"guess": "5"}').done  # the session is still the episode's
    finally:
        env.close()
    text = make_environment("openenv", **GAME, action_key="guess")()
    try:  # action_key: the reply's text is the action's field, whatever it says
        assert text.reset(EXAMPLE) == [{"role": "user", "content": "Guess the number from 0 to 9."}]  # (no schema)
        assert text.step("no idea").messages[0]["content"] == "not a number"
        assert text.step("it is 5").done
    finally:
        text.close()


def test_an_environment_that_raises_in_the_server_raises_from_step(game):
    env = game()
    try:
        env.reset(EXAMPLE)
        with pytest.raises(RuntimeError, match="the game broke.*EXECUTION_ERROR"):
            env.step('{"guess": "crash"}')
    finally:
        env.close()


@pytest.mark.parametrize("options, match", [
    ({"app": APP, "reward": "max"}, r"reward: expected one of \['sum', 'last'\], got 'max'"),
    ({}, r"base_url / app: name exactly one"),
    ({"app": APP, "base_url": "http://127.0.0.1:1"}, r"base_url / app: name exactly one"),
    ({"base_url": "127.0.0.1:8000"}, r"base_url: expected an http://"),
    ({"app": APP, "timeout_s": 0}, r"timeout_s: expected a number > 0"),
    ({"app": APP, "reset_keys": "answer"}, r"reset_keys: expected a list"),
    ({"app": APP, "reset_args": [1]}, r"reset_args: expected a JSON object"),
    ({"app": APP, "action_key": "answer"}, r"action_key: the server's action has no field 'answer'; its fields: "
                                           r"\['guess'\]"),
    ({"app": APP, "observation_key": "text"}, r"observation_key: the server's observation has no field 'text'"),
    ({"app": APP, "colour": 1}, r"unknown option\(s\) \['colour'\]"),
    ({"app": f"{HERE / 'openenv_game.py'}:nope"}, r"app: OpenEnv app .* has no attribute 'nope'"),
    ({"app": f"{HERE / 'openenv_game.py'}:COUNTS"}, r"app: .* is dict, not an ASGI app"),
    ({"app": f"{HERE / 'openenv_game.py'}:broken_app"}, r"app: the OpenEnv app .* could not be served: it stopped "
                                                        r"during startup"),
])
def test_bad_options_fail_at_make_environment_naming_the_option(options, match):
    with pytest.raises(ValueError, match=r"^environment 'openenv': " + match):
        make_environment("openenv", **options)


def test_an_unreachable_base_url_fails_before_any_model_loads(tmp_path, monkeypatch, request):
    from dppo.train import trainer as trainer_module

    import socket

    bound = socket.socket()  # a port bound but not listening: connections are refused, and no one else gets it
    bound.bind(("127.0.0.1", 0))
    request.addfinalizer(bound.close)
    url = f"http://127.0.0.1:{bound.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"base_url: no OpenEnv server answers at {url}"):
        make_environment("openenv", base_url=url, startup_timeout_s=0.5)
    assert time.monotonic() - start < 5

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer_module, "build_model", no_model)
    cfg = smoke_config(tmp_path, rollout={"episodes": "env"},
                       env={"name": "openenv", "options": json.dumps({"base_url": url, "startup_timeout_s": 0.5})})
    with pytest.raises(ValueError, match="base_url: no OpenEnv server answers"):
        trainer_module.Trainer(cfg, tmp_path)


def test_episodes_on_a_server_via_base_url_and_via_app_close_every_session(model, tokenizer, game, monkeypatch):
    """Every episode's client is closed when its episode ends: the server sees as many sessions closed as opened."""
    closes = []
    close = OpenEnvEnv.close
    monkeypatch.setattr(OpenEnvEnv, "close", lambda self: (closes.append(self), close(self)))
    proc, port = _uvicorn()
    try:
        for where in ({"base_url": f"http://127.0.0.1:{port}"}, {"app": APP}):
            url = make_environment("openenv", **where)().server.url
            before = _sessions(url)
            options = {**where, "reset_keys": {"target": "answer"}, "observation_key": "message", "action_key": "guess"}
            rollouts = _collect(model, tokenizer, options, n=3)
            after = _sessions(url)
            assert after["opened"] - before["opened"] == 3 == after["closed"] - before["closed"], (before, after)
            for r in rollouts:
                assert r.episode.env_errors == 0 and 1 <= r.episode.turns <= 3, r.episode.error
                replies = [m for m in r.episode.messages if m["role"] == "user"][1:]
                assert all(m["content"] in ("higher", "lower", "not a number") for m in replies)
    finally:
        proc.kill()
        proc.wait()
    assert len(closes) == 6 == len({id(env) for env in closes})  # once each


def test_a_server_that_dies_mid_episode_ends_it_as_an_env_error(model, tokenizer, monkeypatch):
    closes = []
    close = OpenEnvEnv.close
    monkeypatch.setattr(OpenEnvEnv, "close", lambda self: (closes.append(self), close(self)))
    proc, port = _uvicorn()
    try:
        options = {"base_url": f"http://127.0.0.1:{port}", "reset_args": {"die_on_step": True}, "action_key": "guess",
                   "timeout_s": 5}
        start = time.monotonic()
        rollouts = _collect(model, tokenizer, options, n=2, timeout_s=10)
        assert time.monotonic() - start < 10 and proc.wait(timeout=5) == 1
    finally:
        proc.kill()
        proc.wait()
    for r in rollouts:
        assert r.episode.env_errors == 1 and r.episode.turns == 1 and r.reward == 0.0
        assert r.episode.error.startswith("environment 'openenv': ")
    assert len(closes) == 2 == len({id(env) for env in closes})


def test_openenv_is_registered_and_its_doctests_pass():
    import doctest

    import dppo.envs.openenv

    assert ENVIRONMENTS["openenv"] is OpenEnvEnv
    assert doctest.testmod(dppo.envs.openenv).failed == 0


def test_the_trainer_trains_two_steps_on_an_openenv_game(tmp_path):
    from dppo.train.trainer import Trainer

    options = {**GAME, "action_key": "guess", "system_prompt": "Guess the number: reply with one digit."}
    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "max_new_tokens": 4},
                       env={"name": "openenv", "options": json.dumps(options), "max_turns": 3, "max_tokens": 80},
                       train={"threads": 1, "steps": 2, "mini_batches": 1})
    with Trainer(cfg, tmp_path) as trainer:
        metrics = [trainer.step() for _ in range(2)]
    assert all(m["episode/env_errors"] == 0 and 1 <= m["episode/turns_mean"] <= 3 for m in metrics), metrics
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
    samples = (tmp_path / "samples.jsonl").read_text()
    assert "Guess the number from 0 to 9." in samples and "<error>" not in samples

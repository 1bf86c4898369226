"""verifiers v1 tasksets as the episode kind `verifiers` (dppo.episodes.verifiers, the `verifiers` section):
verifiers' own harness and clients, which dppo did not write, reach the recording proxy: `EvalClient` relaying the
`null` chat harness (chat completions) and `TrainClient` through `renderers` (the token route
`/inference/v1/generate`, with the run's model's tokenizer); every model call is recorded, the taskset's own
`@vf.reward` scores the episode; the taskset's tasks are the run's examples with a held-out split, nothing carried
inside them; bad settings fail before any model loads, naming the field; an older dppo's spelling (task.name /
agent.name verifiers) is refused naming the new one; the trainer trains 2 steps."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
import torch
import yaml

pytest.importorskip("verifiers")

from test_proxy_clients import serve  # noqa: E402 - the proxy on the tiny model, a client in a thread

from dppo._checks import ConfigError  # noqa: E402
from dppo.episodes.settings import VerifiersSettings  # noqa: E402
from dppo.episodes.verifiers import Player, close_all, episode_reward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKSET = str(ROOT / "tests" / "data" / "verifiers" / "dppo_vf_sum.py")
TOOLS = str(ROOT / "tests" / "data" / "verifiers" / "dppo_vf_tools.py")


@pytest.fixture(scope="module")
def model(tiny_model, with_logit_bias):
    """The tiny model, never sampling pad / <|im_start|> / unk, stopping often; digits favoured."""
    return with_logit_bias(tiny_model, {0: -40.0, 2: -40.0, 3: -40.0, 1: 1.0})


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(str(path))
    return str(path)


def first_example(settings: VerifiersSettings):
    """The first training example of the settings' taskset (two tasks, none held out)."""
    return settings.task(size=2, eval_size=0, seed=0).train[0]


def play(player: Player, example, episode: bool = False):
    """A client function for `serve`: one verifiers episode of `example` against the proxy's episode URL, played by
    `player` (its reward: the agent the agent loop runs; `episode`: verifiers' Episode, `Player.play`)."""
    def run(url):
        async def go():
            client = openai.AsyncOpenAI(base_url=url, api_key="episode-key", max_retries=0)
            try:
                return await (player.play if episode else player.agent())(client, example)
            finally:
                await close_all()
        return asyncio.run(go())
    return run


def generated_text(row, tokenizer) -> str:
    return tokenizer.decode([t for t, m in zip(row.tokens.ids, row.tokens.mask) if m], skip_special_tokens=True)


def test_the_tasksets_tasks_are_the_runs_examples_with_a_disjoint_held_out_split():
    settings = VerifiersSettings(taskset=TASKSET, options=json.dumps({"num_tasks": 30}))
    task = settings.task(size=20, eval_size=6, seed=1)
    assert len(task.train) == 20 and len(task.eval) == 6
    assert not {e.uid for e in task.train} & {e.uid for e in task.eval}
    assert len({e.uid for e in task.train}) == 20
    assert not {e.prompt[-1]["content"] for e in task.train} & {e.prompt[-1]["content"] for e in task.eval}
    e = task.train[0]
    a, b = (int(x) for x in e.prompt[-1]["content"].rstrip("?").split("+"))
    assert e.answer == str(a + b) and e.prompt[-1]["role"] == "user"
    assert all(x.metadata == {} and x.uid.startswith("verifiers:") for x in task.train + task.eval)  # nothing carried
    assert all(x.prompt[-1]["role"] == "user" and x.prompt[-1]["content"].strip() and x.answer
               for x in task.train + task.eval)
    again = settings.task(size=20, eval_size=6, seed=1)
    assert [x.uid for x in again.train] == [x.uid for x in task.train]  # seeded
    with pytest.raises(ValueError, match="the taskset's own rewards"):
        task.reward("5", e)


@pytest.mark.parametrize("settings, field", [
    ({}, "verifiers.taskset"), ({"taskset": "no/such/taskset.py"}, "verifiers.taskset"),
    ({"taskset": "no_such_module_dppo"}, "verifiers.taskset"),
    ({"taskset": TASKSET, "options": '{"num_tasks": "many"}'}, "verifiers.options"),
    ({"taskset": TASKSET, "options": '{"no_such_field": 1}'}, "verifiers.options"),
    ({"taskset": TASKSET, "options": '[1]'}, "verifiers.options"),
    ({"taskset": TASKSET, "client": "grpc"}, "verifiers.client"),
    ({"taskset": TASKSET, "harness": "no_such_harness_dppo"}, "verifiers.harness"),
    ({"taskset": TASKSET, "harness": "no/such/harness.py"}, "verifiers.harness"),
    ({"taskset": TASKSET, "harness": TASKSET}, "verifiers.harness")])
def test_bad_settings_fail_before_any_model_loads_naming_the_field(settings, field):
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.")):
        VerifiersSettings(**settings).task(size=2, eval_size=0, seed=0)


def test_the_run_builds_its_examples_and_episodes_from_the_verifiers_section_and_its_model(tmp_path):
    """One section: the trainer's task building asks the episode kind first (the taskset's tasks, split by task.size /
    eval_size / seed; the task section's task set aside, said at start); the episodes' player gets the run's model
    for the train client's tokenizer; a relative taskset is recorded absolute (an id is left to verifiers); a kind
    with no taskset is refused naming the field; the verifiers section under another kind is refused (without the
    verifiers package: tests/test_extras.py)."""
    from conftest import smoke_config

    from dppo.train.build import build_episodes, build_task
    from dppo.train.resolve import absolute_paths, resolution_notes

    cfg = smoke_config(tmp_path, rollout={"episodes": "verifiers"}, task={"size": 5, "eval_size": 3, "seed": 2},
                       verifiers={"taskset": TASKSET, "client": "train"}, proxy={"max_tokens": 64})
    task = build_task(cfg)
    assert [e.uid for e in task.train] == [e.uid for e in cfg.verifiers.task(size=5, eval_size=3, seed=2).train]
    assert len(task.train) == 5 and len(task.eval) == 3
    assert resolution_notes(cfg)[-1] == (f"[dppo] task.name and task.options are not used: the verifiers taskset "
                                         f"{TASKSET!r} supplies the run's examples (task.size, task.eval_size and "
                                         f"task.seed split them)")  # (the smoke preset's addition task)
    episodes = build_episodes(cfg, task)
    assert episodes.player == Player(cfg.verifiers, tokenizer=cfg.model.name) and episodes.max_turns == 16
    assert episodes.settings == cfg.proxy and episodes.settings.max_tokens == 64
    for given, want in (("my_sums.py", str(tmp_path / "my_sums.py")), ("sets/sums", str(tmp_path / "sets" / "sums")),
                        ("gsm8k", "gsm8k"), ("/abs/x.py", "/abs/x.py")):
        resolved = absolute_paths(smoke_config(tmp_path, rollout={"episodes": "verifiers"},
                                               verifiers={"taskset": given, "harness": "h.py"}), tmp_path).verifiers
        assert (resolved.taskset, resolved.harness) == (want, str(tmp_path / "h.py")), given
    with pytest.raises(ValueError, match=r"^verifiers\.taskset: rollout\.episodes verifiers needs a taskset"):
        build_task(smoke_config(tmp_path, rollout={"episodes": "verifiers"}))
    with pytest.raises(ConfigError, match=r"^verifiers\.taskset: a setting of the verifiers episodes, but the run's "
                                          r"episodes are 'single'"):
        smoke_config(tmp_path, verifiers={"taskset": TASKSET})


def test_an_older_dppos_task_and_agent_named_verifiers_are_refused_naming_the_new_spelling(tmp_path):
    """A run directory of an older dppo (task.name verifiers + agent.name verifiers), its flags and the Python config
    are refused before any model loads, naming each moved field and rollout.episodes verifiers."""
    from conftest import smoke_config

    from dppo.cli import parse_config
    from dppo.train.config import Config

    old = {"rollout": {"episodes": "agent"}, "agent": {"name": "verifiers", "max_tokens": 64},
           "task": {"name": "verifiers", "options": json.dumps({"taskset": TASKSET, "client": "eval"})}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError, match=r"^agent\.max_tokens: .*config\.yaml was written by an older dppo; edit "
                                          r"it: agent\.max_tokens is now proxy\.max_tokens; task\.name verifiers is "
                                          r"now rollout\.episodes verifiers with the taskset in verifiers\.taskset "
                                          r".*; agent\.name verifiers is now rollout\.episodes verifiers "
                                          r"\(agent\.max_calls, max_tokens, timeout_s and concurrency are proxy\.\*\)"):
        Config.load(tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"^--task\.name: a flag of an older dppo; --task\.name verifiers is now "
                                          r"--rollout\.episodes verifiers"):
        parse_config(["--preset", "smoke", "--rollout.episodes", "agent", "--agent.name=verifiers",
                      "--task.name", "verifiers"], prog="dppo train")
    with pytest.raises(ConfigError, match=r"^task\.name: config spells what an older dppo did; task\.name verifiers "
                                          r"is now rollout\.episodes verifiers"):
        smoke_config(tmp_path, task={"name": "verifiers"})


@pytest.mark.parametrize("harness, streams", [("", True), ("tests/data/verifiers/dppo_vf_plain_harness.py", False)])
def test_eval_client_relaying_a_chat_harness_is_recorded_and_scored_by_the_tasks_reward(
        model, tokenizer, monkeypatch, harness, streams):
    """verifiers' `null` chat harness streams (`stream: true` relayed to the proxy as an SSE stream); the test's plain
    harness asks without streaming."""
    from verifiers.v1.clients.eval import EvalClient

    sent, request = [], EvalClient._request

    async def spy(self, url, body, headers, stream=False):  # what verifiers' client sends upstream, unchanged
        sent.append((url, bool(body.get("stream")), stream))
        return await request(self, url, body, headers, stream=stream)

    monkeypatch.setattr(EvalClient, "_request", spy)
    settings = VerifiersSettings(taskset=TASKSET, client="eval", harness=harness and str(ROOT / harness))
    example = first_example(settings)
    reward, ep = serve(model, tokenizer, play(Player(settings, tokenizer=""), example))
    assert ep.calls == len(sent) >= 1 and ep.refused == 0 and len(ep.rows) >= 1
    assert all(url.endswith("/chat/completions") and body_stream == streams == relayed for url, body_stream, relayed
               in sent), sent
    prompt = tokenizer.decode(ep.rows[0].tokens.prompt_ids)
    assert example.prompt[-1]["content"] in prompt  # the harness rendered the task's prompt; the proxy recorded it
    # the task's @vf.reward: 1 when the answer is in the last reply (the one the proxy generated)
    assert reward == float(example.answer in generated_text(ep.rows[-1], tokenizer))


def test_a_taskset_whose_reward_the_model_meets_scores_one(model, tokenizer):
    """The reward is the taskset's, not a constant: a task whose answer the tiny model's reply surely holds (the empty
    string is in every reply) scores 1 through the same path."""
    settings = VerifiersSettings(taskset=TASKSET, options=json.dumps({"num_tasks": 40, "empty_answers": True}))
    reward, _ = serve(model, tokenizer, play(Player(settings, tokenizer=""), first_example(settings)))
    assert reward == 1.0


def test_train_client_reaches_the_token_route_through_renderers_and_gets_mu_as_recorded(model, tokenizer, tokenizer_dir):
    """`TrainClient` renders with the run's model's tokenizer (the player's `tokenizer`: here the tiny model's)."""
    settings = VerifiersSettings(taskset=TASKSET, client="train")
    example = first_example(settings)
    episode, ep = serve(model, tokenizer, play(Player(settings, tokenizer=tokenizer_dir), example, episode=True))
    assert ep.calls >= 1 and ep.refused == 0 and len(ep.rows) == 1
    assert example.prompt[-1]["content"] in tokenizer.decode(ep.rows[0].tokens.prompt_ids)
    (trace,) = episode.traces
    (branch,) = trace.branches
    (row,) = ep.rollouts(eos_id=1, version=0)
    # verifiers' sample (what renderers tokenised and the token route returned) is the proxy's row, token for token
    assert branch.token_ids == ep.rows[0].tokens.context()
    sampled = [i for i, m in enumerate(branch.sampled_mask) if m]
    assert [branch.token_ids[i] for i in sampled] == [t for t, m in zip(ep.rows[0].tokens.ids, ep.rows[0].tokens.mask)
                                                      if m]
    # and the sampling logprobs it holds are µ as recorded (the loss's anchor)
    returned = torch.tensor([branch.logprobs[i] for i in sampled])
    assert torch.equal(returned, row.rollout_logp[row.loss_mask].float())
    assert episode_reward(episode) == float(example.answer in generated_text(ep.rows[-1], tokenizer))


@pytest.mark.parametrize("taskset", ["sum", "tools"])
def test_the_trainer_trains_two_steps_on_a_verifiers_taskset(tmp_path, taskset):
    """One prompt of 2 episodes a step (each episode a harness process; the tool-using taskset's also a tool server):
    the smallest run that still has a group to centre."""
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, task={"size": 8, "eval_size": 2},
                       verifiers={"taskset": {"sum": TASKSET, "tools": TOOLS}[taskset], "client": "eval"},
                       proxy={"max_tokens": 64},
                       rollout={"episodes": "verifiers", "engine": "hf", "dtype": "float32", "max_new_tokens": 4,
                                "prompts_per_step": 1, "group_size": 2},
                       train={"threads": 1, "steps": 2, "micro_batch_size": 4, "mini_batches": 1})
    trainer = Trainer(cfg, run_dir=tmp_path)
    try:
        metrics = [trainer.step() for _ in range(2)]
    finally:
        trainer.close()
    from dppo.episodes import verifiers as kind_module
    assert not kind_module._SERVING  # the run's end left verifiers' serving environment (its servers stopped)
    errors = [line for line in (tmp_path / "samples.jsonl").read_text().splitlines() if "<error>" in line]
    assert all(m["episode/env_errors"] == 0 for m in metrics), [e[e.index("<error>"):][:400] for e in errors]
    assert all(m["episode/turns_mean"] >= 1 for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all("reward" in s for s in samples)


def test_a_tool_using_tasksets_tools_are_offered_to_the_model_through_the_proxy(model, tokenizer):
    settings = VerifiersSettings(taskset=TOOLS, client="eval")
    example = first_example(settings)
    episode, ep = serve(model, tokenizer, play(Player(settings, tokenizer=""), example, episode=True))
    assert ep.calls >= 1 and ep.refused == 0
    prompt = tokenizer.decode(ep.rows[0].tokens.prompt_ids)
    assert "Add two integers" in prompt, prompt  # the tool's description (the task's own prompt names no such thing)
    assert episode_reward(episode) == float(example.answer in generated_text(ep.rows[-1], tokenizer))

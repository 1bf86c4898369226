"""verifiers v1 tasksets as episodes (dppo.tasks.verifiers, dppo.episodes.verifiers): verifiers' own harness and
clients, which dppo did not write, reach the recording proxy: `EvalClient` relaying the `null` chat harness (chat
completions) and `TrainClient` through `renderers` (the token route `/inference/v1/generate`); every model call is
recorded, the taskset's own `@vf.reward` scores the episode; the taskset's tasks are the run's examples with a
held-out split; bad options fail before any model loads, naming the field; the trainer trains 2 steps."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch

pytest.importorskip("verifiers")

from test_proxy_clients import serve  # noqa: E402 - the proxy on the tiny model, a client in a thread

from dppo.episodes.verifiers import agent, close_all, episode_reward  # noqa: E402
from dppo.episodes.verifiers import play as play_episode  # noqa: E402
from dppo.tasks import make_task  # noqa: E402
from dppo.tasks.verifiers import verifiers_task  # noqa: E402

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


def play(example, fn=agent):
    """A client function for `serve`: one verifiers episode of `example` against the proxy's episode URL (`fn`: the
    agent, its reward; `episodes.verifiers.play`, verifiers' Episode)."""
    def run(url):
        async def go():
            client = openai.AsyncOpenAI(base_url=url, api_key="episode-key", max_retries=0)
            try:
                return await fn(client, example)
            finally:
                await close_all()
        return asyncio.run(go())
    return run


def generated_text(row, tokenizer) -> str:
    return tokenizer.decode([t for t, m in zip(row.tokens.ids, row.tokens.mask) if m], skip_special_tokens=True)


def test_the_tasksets_tasks_are_the_runs_examples_with_a_disjoint_held_out_split():
    task = make_task("verifiers", taskset=TASKSET, config={"num_tasks": 30}, size=20, eval_size=6, seed=1)
    assert len(task.train) == 20 and len(task.eval) == 6
    assert not {e.uid for e in task.train} & {e.uid for e in task.eval}
    e = task.train[0]
    a, b = (int(x) for x in e.prompt[-1]["content"].rstrip("?").split("+"))
    assert e.answer == str(a + b) and e.prompt[-1]["role"] == "user"
    spec = e.metadata["verifiers"]
    assert spec["taskset"] == TASKSET and spec["config"] == {"num_tasks": 30} and spec["client"] == "eval"
    again = make_task("verifiers", taskset=TASKSET, config={"num_tasks": 30}, size=20, eval_size=6, seed=1)
    assert [x.uid for x in again.train] == [x.uid for x in task.train]  # seeded
    with pytest.raises(ValueError, match="the taskset's own rewards"):
        task.reward("5", e)


@pytest.mark.parametrize("options, field", [
    ({}, "task.options.taskset"), ({"taskset": "no/such/taskset.py"}, "task.options.taskset"),
    ({"taskset": "no_such_module_dppo"}, "task.options.taskset"),
    ({"taskset": TASKSET, "config": {"num_tasks": "many"}}, "task.options.config"),
    ({"taskset": TASKSET, "config": {"no_such_field": 1}}, "task.options.config"),
    ({"taskset": TASKSET, "client": "grpc"}, "task.options.client"),
    ({"taskset": TASKSET, "client": "train"}, "task.options.tokenizer"),
    ({"taskset": TASKSET, "harness": "no_such_harness_dppo"}, "task.options.harness"),
    ({"taskset": TASKSET, "harness": "no/such/harness.py"}, "task.options.harness"),
    ({"taskset": TASKSET, "harness": TASKSET}, "task.options.harness")])
def test_bad_options_fail_before_any_model_loads_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        verifiers_task(**options)


def test_the_verifiers_task_and_agent_go_together_checked_before_any_model_loads(tmp_path):
    from conftest import smoke_config
    from dppo._checks import ConfigError

    options = json.dumps({"taskset": TASKSET})
    with pytest.raises(ConfigError, match=r"^task\.name: a verifiers taskset is played by verifiers' harness"):
        smoke_config(tmp_path, task={"name": "verifiers", "options": options})
    with pytest.raises(ConfigError, match=r"^agent\.name: agent 'verifiers' plays the tasks of task\.name verifiers"):
        smoke_config(tmp_path, agent={"name": "verifiers"}, rollout={"episodes": "agent"})


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
    example = verifiers_task(taskset=TASKSET, size=2, client="eval", harness=harness and str(ROOT / harness)).train[0]
    reward, ep = serve(model, tokenizer, play(example))
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
    example = verifiers_task(taskset=TASKSET, size=2, client="eval").train[0]
    spec = {**example.metadata["verifiers"], "config": {"num_tasks": 40, "empty_answers": True}}
    reward, _ = serve(model, tokenizer, play(replace(example, metadata={"verifiers": spec})))
    assert reward == 1.0


def test_train_client_reaches_the_token_route_through_renderers_and_gets_mu_as_recorded(model, tokenizer, tokenizer_dir):
    example = verifiers_task(taskset=TASKSET, size=2, client="train", tokenizer=tokenizer_dir).train[0]
    episode, ep = serve(model, tokenizer, play(example, fn=play_episode))
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
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    options = {"taskset": {"sum": TASKSET, "tools": TOOLS}[taskset], "client": "eval"}
    cfg = smoke_config(tmp_path, task={"name": "verifiers", "options": json.dumps(options), "size": 8, "eval_size": 2},
                       agent={"name": "verifiers", "max_tokens": 64},
                       rollout={"episodes": "agent", "engine": "hf", "dtype": "float32", "max_new_tokens": 4,
                                "prompts_per_step": 2, "group_size": 2},
                       train={"threads": 1, "steps": 2, "micro_batch_size": 4})
    trainer = Trainer(cfg, run_dir=tmp_path)
    try:
        metrics = [trainer.step() for _ in range(2)]
    finally:
        trainer.close()
    from dppo.episodes import verifiers as agent_module
    assert not agent_module._SERVING  # the run's end left verifiers' serving environment (its servers stopped)
    errors = [line for line in (tmp_path / "samples.jsonl").read_text().splitlines() if "<error>" in line]
    assert all(m["episode/env_errors"] == 0 for m in metrics), [e[e.index("<error>"):][:400] for e in errors]
    assert all(m["episode/turns_mean"] >= 1 for m in metrics)
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all("reward" in s for s in samples)


def test_a_tool_using_tasksets_tools_are_offered_to_the_model_through_the_proxy(model, tokenizer):
    example = verifiers_task(taskset=TOOLS, size=2, client="eval").train[0]
    episode, ep = serve(model, tokenizer, play(example, fn=play_episode))
    assert ep.calls >= 1 and ep.refused == 0
    prompt = tokenizer.decode(ep.rows[0].tokens.prompt_ids)
    assert "Add two integers" in prompt, prompt  # the tool's description (the task's own prompt names no such thing)
    assert episode_reward(episode) == float(example.answer in generated_text(ep.rows[-1], tokenizer))

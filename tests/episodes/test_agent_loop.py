"""The recording proxy and agents (`dppo.episodes`) against obviously-correct references: µ and µ's top-K recorded
through the proxy are a plain fp32 forward of the sampling weights; a multi-call episode's row decodes to exactly
the chat template's transcript with only the sampled tokens trained; a call that does not extend a row (a template
that strips earlier reasoning, an edited history) starts a new row; refused sampling parameters get the OpenAI
error shape naming the field; agents that raise, hang, return garbage or send malformed requests are contained and
counted; the trainer trains on agent rows, an episode's rows sharing its advantage.

The agents live in tests/data/agents.py and are loaded by file path, as a user's are.
"""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import openai
import pytest
import torch

from dppo.episodes.agent_loop import AgentEpisodes
from dppo.episodes.chat import reply_message
from dppo.episodes.env_loop import EnvCollector
from dppo.episodes.proxy import Proxy
from dppo.episodes.proxy_requests import RequestError, check_request
from dppo.episodes.results import episode_rewards, first_rows, row_episodes
from dppo.episodes.settings import AgentSettings, EnvSettings, ProxySettings
from dppo.example import Example
from dppo.rollout.base import SamplingParams
from dppo.rollout.hf import HFEngine
from dppo.train.batch import collate, minibatches
from dppo.train.scoring import score_responses_reference

AGENTS = Path(__file__).resolve().parents[1] / "data" / "agents.py"
EXAMPLES = [Example(prompt=({"role": "user", "content": "2+3?"},), answer="5"),
            Example(prompt=({"role": "user", "content": "17*3?"},), answer="51")]
K = 4


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"n": 2, "max_new_tokens": 8, "top_k_logprobs": K, "stop_token_ids": (1,), "seed": 3, **kw})


@pytest.fixture(scope="module")
def model(tiny_model, with_logit_bias):
    """The tiny model, never sampling pad / <|im_start|> / unk (decoded replies are the sampled text)."""
    return with_logit_bias(tiny_model, {0: -40.0, 2: -40.0, 3: -40.0, 1: 1.0})


BATCHES: list[list[int]] = []
"""The engine calls' sizes of each `collect` (its proxy's `batch_sizes`), newest last."""


def spec(name: str, max_tokens: int = 128, **proxy) -> AgentEpisodes:
    """The episodes of agent `name` of tests/data/agents.py through a proxy of the run config's defaults but `proxy`'s
    (its rows' budget `max_tokens`)."""
    return AgentSettings(name=f"{AGENTS}:{name}").episodes(
        max_new_tokens=8, proxy=ProxySettings(max_tokens=max_tokens, **proxy))


def collect(name: str, engine, examples=EXAMPLES, p=None, **proxy):
    collector = spec(name, **proxy).collector()
    try:
        return collector(engine, examples, p or params())
    finally:
        BATCHES.append(collector.proxy.batch_sizes if collector.proxy else [])
        collector.close()


@pytest.fixture(scope="module")
def two_call_rows(model, tokenizer):
    return collect("two_calls", HFEngine(model, tokenizer))


def test_mu_and_its_topk_through_the_proxy_are_a_plain_fp32_forward(two_call_rows, model):
    batch = collate(two_call_rows, pad_id=0)
    ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                    topk_ids=batch.rollout_topk_ids)
    gen = batch.loss_mask
    assert int(gen.sum()) > 20 and (~gen & batch.response_mask).any()
    assert torch.allclose(ref.logp[gen], batch.rollout_logp[gen], rtol=0, atol=2e-5)
    valid = batch.rollout_topk_valid & gen[..., None]
    assert torch.allclose(ref.topk_logp[valid], batch.rollout_topk_logp[valid], rtol=0, atol=2e-5)
    assert not batch.rollout_topk_valid[~gen].any() and (batch.rollout_logp[~gen] == 0).all()


def test_a_two_call_episode_is_one_row_that_decodes_to_the_templates_transcript(two_call_rows, tokenizer):
    assert len(two_call_rows) == 4 and [r.row for r in two_call_rows] == [0, 0, 0, 0]
    for r in two_call_rows:
        mask, turn = r.loss_mask.tolist(), r.turn_index.tolist()
        ids = r.response_ids.tolist()
        first = [t for t, m, j in zip(ids, mask, turn) if m and j == 0]
        second = [t for t, m, j in zip(ids, mask, turn) if m and j == 1]
        assert 1 <= len(first) <= 5 and second and r.episode.turns == 2
        replies = [tokenizer.decode(x, skip_special_tokens=True) for x in (first, second)]
        messages = [{"role": "user", "content": EXAMPLES[r.prompt_index].prompt[0]["content"]},
                    {"role": "assistant", "content": replies[0]}, {"role": "user", "content": "again"},
                    {"role": "assistant", "content": replies[1]}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        text = tokenizer.decode(r.prompt_ids.tolist() + ids)
        assert rendered.startswith(text) and rendered[len(text):] in ("", "<|im_end|>\n", "\n")
        # the generated segments are contiguous and mask 1; everything between them is the template's (mask 0)
        assert mask[:len(first)] == [True] * len(first) and mask[-len(second):] == [True] * len(second)
        assert not any(mask[len(first):-len(second)])


def test_concurrent_agents_calls_are_batched_into_one_engine_call_per_round(model, tokenizer, monkeypatch):
    # The batch goes once every running episode has a call in flight; the window for a late one (0.2 s by default)
    # made long, so that a loaded machine's slow thread does not split a round (seen under load average 10)
    monkeypatch.setattr(Proxy.__init__, "__kwdefaults__", {"batch_wait_s": 10.0})
    engine = HFEngine(model, tokenizer)
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, p: calls.append(len(prompts)) or generate(prompts, p)
    rows = collect("two_calls", engine, p=params(n=4))
    assert len(first_rows(rows)) == 8
    # first calls (max_tokens 5), then second calls (8): one engine call each
    assert calls == [8, 8] and BATCHES[-1] == [8, 8]


def test_an_agent_makes_exactly_the_rows_of_the_same_loop_as_an_environment(model, tokenizer):
    """The Scripted environment's loop as an agent: same engine, same seed, so the same samples — and the proxy's
    rows are the environment's episodes token for token (ids, masks, turns, versions), µ and µ's top-K included."""
    env = EnvSettings(f"{Path(__file__).resolve().parents[1] / 'data' / 'scripted_env.py'}:Scripted", '{"turns": 3}', max_turns=3,
                      max_tokens=1000)
    p = params(n=3)
    envs = EnvCollector(env)(HFEngine(model, tokenizer), EXAMPLES, p)
    agents = collect("scripted", HFEngine(model, tokenizer), p=p, max_tokens=1000)
    assert len(agents) == len(envs) == 6 and [r.row for r in agents] == [0] * 6
    assert sum(int((~r.loss_mask).sum()) for r in envs) > 20  # (tool answers and inserted stop tokens)
    for a, e in zip(agents, envs):
        assert a.prompt_ids.tolist() == e.prompt_ids.tolist() and a.response_ids.tolist() == e.response_ids.tolist()
        for name in ("loss_mask", "turn_index", "token_versions", "rollout_topk_ids", "rollout_topk_valid"):
            assert torch.equal(getattr(a, name), getattr(e, name)), name
        assert torch.allclose(a.rollout_logp, e.rollout_logp, rtol=0, atol=1e-6)
        assert torch.allclose(a.rollout_topk_logp, e.rollout_topk_logp, rtol=0, atol=1e-6)
        assert a.reward == e.reward and a.episode.turns == e.episode.turns == 3


def test_an_async_agent_and_a_posted_reward(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    rows = collect("two_calls_async", engine, p=params(n=1))
    assert len(rows) == 2 and all(r.episode.turns == 2 and r.episode.error is None for r in rows)
    posted = collect("posts_reward", engine, p=params(n=1))
    assert [r.reward for r in posted] == [0.25, 0.25]


def test_an_edited_history_starts_a_new_row_sharing_the_reward(model, tokenizer):
    rows = collect("edits_history", HFEngine(model, tokenizer))
    assert [r.row for r in rows] == [0, 1] * 4 and all(r.reward == 0.5 for r in rows)
    second = rows[1]
    assert "edited" in tokenizer.decode(second.prompt_ids.tolist())  # the request as the template renders it
    assert second.loss_mask.all() and (second.turn_index == 1).all()
    rewards, _ = episode_rewards(rows)
    assert rewards.tolist() == [0.5] * 4 and row_episodes(rows).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def _stripping(tokenizer):
    """A Qwen3-style template: assistant messages before the last user message lose their reasoning (up to '#')."""
    out = copy.deepcopy(tokenizer)
    out.chat_template = (
        "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
        "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
        "{%- for m in messages -%}{%- set c = m.content -%}"
        "{%- if m.role == 'assistant' and loop.index0 < ns.last -%}{%- set c = c.split('#')[-1] -%}{%- endif -%}"
        "{{ '<|im_start|>' + m.role + '\n' + c + '<|im_end|>' + '\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
    return out


def test_a_template_that_strips_earlier_reasoning_starts_a_new_row(tiny_model, with_logit_bias, tokenizer):
    hash_id = tokenizer.convert_tokens_to_ids("#")
    tok = _stripping(tokenizer)
    biased = with_logit_bias(tiny_model, {0: -40.0, 2: -40.0, 3: -40.0, 1: -40.0, hash_id: 3.0})
    rows = collect("two_calls", HFEngine(biased, tok), p=params(n=4))
    firsts = [r for r in rows if r.row == 0]
    assert len(firsts) == 8
    by_episode = {}
    for r, e in zip(rows, row_episodes(rows).tolist()):
        by_episode.setdefault(e, []).append(r)
    split = 0
    for group in by_episode.values():
        first_reply = tok.decode([t for t, m, j in zip(group[0].response_ids.tolist(), group[0].loss_mask.tolist(),
                                                        group[0].turn_index.tolist()) if m and j == 0])
        if "#" in first_reply:  # the template rewrites it when the second call comes: a new row
            split += 1
            assert len(group) == 2 and group[1].row == 1
            text = tok.decode(group[1].prompt_ids.tolist())
            assert first_reply.split("#")[-1] + "<|im_end|>" in text and first_reply not in text
        else:
            assert len(group) == 1
    assert split >= 4  # (the bias on '#' makes most first replies hold one)


def test_completion_calls_with_token_ids_join_by_ids(model, tokenizer):
    ids_of = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    examples = [Example(prompt=({"role": "user", "content": "x"},), answer="1", metadata={"ids_of": ids_of})]
    rows = collect("completions_ids", HFEngine(model, tokenizer), examples=examples, p=params(n=3))
    assert len(rows) == 3
    for r in rows:
        assert r.prompt_ids.tolist() == [5, 6, 7]
        mask = r.loss_mask.tolist()
        assert mask.count(True) >= 2 and r.response_ids.tolist()[mask.index(False):][:2] == [8, 9]


@pytest.mark.parametrize("body, param", [
    ({"temperature": 0.5}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"n": 2}, "n"),
    ({"logit_bias": {"5": 3}}, "logit_bias"), ({"use_beam_search": True}, "use_beam_search"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"stop": ["\n"]}, "stop"), ({"stream": "yes"}, "stream"),
    ({"tool_choice": "required"}, "tool_choice"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frobnicate": 1}, "frobnicate"), ({"max_tokens": 0}, "max_tokens")])
def test_a_refused_sampling_parameter_gets_the_openai_error_shape(model, tokenizer, body, param):
    proxy = Proxy(ProxySettings(max_tokens=128))
    proxy.start()
    try:
        proxy.begin(HFEngine(model, tokenizer), params())
        ep = proxy.open(0, EXAMPLES[0])
        client = openai.OpenAI(base_url=proxy.base_url(ep), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                           extra_body=body)
        error = err.value.response.json()["error"]
        assert err.value.status_code == 400 and error["type"] == "invalid_request_error"
        assert error["param"] == param and param in error["message"]
        assert ep.refused == 1 and ep.calls == 0
        with pytest.raises(openai.NotFoundError):  # an unknown episode
            openai.OpenAI(base_url=proxy.base_url(ep).replace(ep.key, "nope"), api_key="x",
                          max_retries=0).models.list()
    finally:
        proxy.stop()


def test_exposed_proxy_needs_the_runs_key_and_caps_request_size(model, tokenizer):
    proxy = Proxy(ProxySettings(host="0.0.0.0", max_request_bytes=2000, max_tokens=128))
    proxy.start()
    try:
        proxy.begin(HFEngine(model, tokenizer), params())
        ep = proxy.open(0, EXAMPLES[0])
        url = proxy.base_url(ep)
        assert httpx.get(f"{url}/models").status_code == 401
        assert httpx.get(f"{url}/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert openai.OpenAI(base_url=url, api_key=proxy.key).models.list().data[0].id == "dppo-policy"
        big = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {proxy.key}"},
                         json={"messages": [{"role": "user", "content": "x" * 5000}]})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    finally:
        proxy.stop()


@pytest.mark.parametrize("agent, counter, error", [
    ("raises", "env_errors", "RuntimeError: boom"), ("hangs", "env_timeouts", "timed out after 2s"),
    ("returns_garbage", "env_errors", "expected a finite number")])
def test_an_agent_that_raises_hangs_or_returns_garbage_is_contained_and_counted(model, tokenizer, agent, counter, error):
    rows = collect(agent, HFEngine(model, tokenizer), p=params(n=1), timeout_s=2.0)
    eps = first_rows(rows)
    assert len(eps) == 2 and all(r.reward == 0.0 and getattr(r.episode, counter) == 1.0 for r in eps)
    assert all(error in r.episode.error and error in r.episode.completion for r in eps)
    if agent == "returns_garbage":  # no call made: one row, nothing trained
        assert all(not r.loss_mask.any() for r in rows)


def test_malformed_requests_are_refused_counted_and_the_episode_goes_on(model, tokenizer):
    rows = collect("malformed_then_fine", HFEngine(model, tokenizer), p=params(n=1))
    assert [r.reward for r in rows] == [1.0, 1.0] and all(r.episode.error is None for r in rows)
    assert spec("malformed_then_fine").metrics(rows)["episode/refused_calls_mean"] == 2.0


def test_check_request_and_reply_message_units():
    req = check_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                                      {"role": "assistant", "content": None, "tool_calls": [
                                          {"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}],
                         "temperature": 1.0, "max_completion_tokens": 7}, "chat", temperature=1.0)
    assert req.messages == [{"role": "system", "content": "a"},
                            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "f",
                                                                                  "arguments": {"x": 1}}]}]
    assert req.max_tokens == 7
    with pytest.raises(RequestError, match="messages"):
        check_request({"messages": []}, "chat", temperature=1.0)
    message, kind = reply_message('ok <tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>', 3)
    assert kind == "tool_calls" and message["content"] == "ok"
    assert message["tool_calls"] == [{"id": "call_3", "type": "function",
                                      "function": {"name": "f", "arguments": "{\"x\": 2}"}}]
    assert reply_message("<tool_call>{bad</tool_call>", 0) == ({"role": "assistant",
                                                                 "content": "<tool_call>{bad</tool_call>"}, "stop")


def test_minibatches_keep_an_episodes_rows_and_its_group_together():
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])  # rows of 4 groups (rows per group vary)
    for epoch in range(3):
        mbs = minibatches(groups, 2, seed=1, step=0, epoch=epoch, device=torch.device("cpu"))
        assert sorted(torch.cat(mbs).tolist()) == list(range(10))
        for mb in mbs:
            gs = set(groups[mb].tolist())
            assert all(set((groups == g).nonzero().squeeze(1).tolist()) <= set(mb.tolist()) for g in gs)


MODES = {"sync": {}, "lagged": {"engine_lag": 1},
         "async": {"mode": "async", "max_staleness": 1, "worker_threads": 1, "worker_timeout_s": 60.0}}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_trainer_trains_on_agent_rows_in_every_mode_and_mu_is_the_sampling_versions(tmp_path, mode):
    """Through the proxy (in the trainer's process, or in an async rollout worker's), µ on every generated token is
    the fp32 distribution of the published version that sampled it; the inserted tokens are not trained."""
    from conftest import smoke_config
    from test_async_source import _Recording
    from test_env_loop import check_mu_is_the_sampling_versions

    cfg = smoke_config(tmp_path, agent={"name": f"{AGENTS}:scripted"}, proxy={"max_tokens": 120},
                       rollout={"episodes": "agent", "engine": "hf", "dtype": "float32", "max_new_tokens": 4, **MODES[mode]},
                       train={"threads": 1, "steps": 3})
    trainer = _Recording(cfg, tmp_path)
    try:
        metrics = [trainer.step() for _ in range(3)]
        stale = check_mu_is_the_sampling_versions(trainer)
    finally:
        trainer.close()
    assert stale == ({0} if mode == "sync" else {0, 1})
    last = metrics[-1]
    assert last["episode/turns_mean"] == 3.0 and last["episode/rows_mean"] == 1.0 and last["episode/env_errors"] == 0
    assert all(f"mismatch/binary_tv_turn_{j}" in last for j in range(3))
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
    assert "<tool [env]> result 1" in (tmp_path / "samples.jsonl").read_text()


@pytest.mark.parametrize("region", ["dppo_binary_tv", "dppo_topk_kl"])
def test_an_episodes_rows_share_its_advantage_in_the_trainer(tmp_path, region):
    from conftest import smoke_config
    from dppo.advantages import compute_advantages
    from dppo.train.trainer import Trainer

    class Recording(Trainer):
        def _update(self, batch, adv, old, timer=None):
            self.seen = (batch, adv.clone())
            return super()._update(batch, adv, old, timer)

    cfg = smoke_config(tmp_path, agent={"name": f"{AGENTS}:edits_history"}, proxy={"max_tokens": 64},
                       rollout={"episodes": "agent", "engine": "hf", "max_new_tokens": 4}, train={"steps": 1, "mini_batches": 2},
                       loss={"trust_region": region})
    trainer = Recording(cfg, tmp_path)
    taken = []
    take = trainer.source.take
    trainer.source.take = lambda step: taken.append(take(step)) or taken[-1]
    try:
        metrics = trainer.step()
    finally:
        trainer.close()
    _, rollouts = taken[0]
    batch, adv = trainer.seen
    G = cfg.rollout.group_size
    assert metrics["episode/rows_mean"] == 2.0 and batch.response_ids.shape[0] == 2 * len(first_rows(rollouts))
    rewards, _ = episode_rewards(rollouts)
    assert rewards.unique().numel() > 1  # (the advantages are not all zero)
    expected = compute_advantages(cfg.advantage.estimator, rewards, G)[0][row_episodes(rollouts)]
    assert torch.equal(adv.cpu(), expected)
    assert torch.isfinite(torch.tensor(metrics["loss/policy"]))
    if region == "dppo_topk_kl":  # µ's top-K cells on every row's generated tokens
        assert batch.rollout_topk_valid[batch.loss_mask].any(-1).all()


def test_an_agents_calls_past_env_max_turns_are_turn_units_of_their_own_in_the_loss(tmp_path, monkeypatch):
    """Per-turn units (`loss.sequence_unit turn`, and GSPO per turn) number an agent's turns by call, up to
    proxy.max_calls: the loss's unit count comes from the episode kind (`max_turns`: the agent's calls), so no call
    is merged into another's unit. (Before, the trainer passed env.max_turns, 4 by default: calls 5 and 6 were
    clamped into call 4's unit.)"""
    from conftest import smoke_config
    from dppo.sequence_mask import unit_index
    from dppo.train import trainer as trainer_module

    seen = []
    loss_inputs = trainer_module.loss_inputs

    def recording(batch, micro, *args, **kwargs):
        inputs = loss_inputs(batch, micro, *args, **kwargs)
        seen.append((batch.loss_mask[micro], inputs))
        return inputs

    monkeypatch.setattr(trainer_module, "loss_inputs", recording)
    cfg = smoke_config(tmp_path, agent={"name": f"{AGENTS}:six_calls"}, proxy={"max_calls": 8, "max_tokens": 400},
                       rollout={"episodes": "agent", "engine": "hf", "max_new_tokens": 4}, train={"threads": 1, "steps": 1},
                       loss={"sequence_mask": "max_divergence", "sequence_unit": "turn"})
    assert cfg.env.max_turns == 4
    with trainer_module.Trainer(cfg, tmp_path) as trainer:
        metrics = trainer.step()
    assert metrics["episode/turns_mean"] == 6.0 and metrics["episode/env_errors"] == 0
    assert seen
    calls = 0
    for mask, inputs in seen:
        units, _ = unit_index(mask, inputs.turn_index, inputs.n_turns)
        for b in range(mask.shape[0]):
            turns, row_units = inputs.turn_index[b][mask[b]].tolist(), units[b][mask[b]].tolist()
            assert len(set(turns)) == len(set(row_units)) == len(set(zip(turns, row_units)))  # one unit per call
            calls = max(calls, len(set(turns)))
    assert calls == 6 and all(inputs.n_turns == 8 for _, inputs in seen)  # proxy.max_calls


def test_bad_agent_settings_fail_before_any_model_loads(tmp_path, monkeypatch):
    from conftest import smoke_config
    from dppo.train import trainer as trainer_module

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer_module, "build_model", no_model)
    for agent, extra, match in [
            ({"name": f"{AGENTS}:missing"}, {}, "^agent.name: agent .* has no attribute 'missing'"),
            ({"name": "no_such_module_x:solve"}, {}, "^agent.name: agent .* cannot import module"),
            ({"name": f"{AGENTS}:_question"}, {}, "^agent.name: .* must take \\(client, example\\)"),
            ({"name": "nocolon"}, {}, "^agent.name: expected 'module:function'"),
            ({"name": f"{AGENTS}:two_calls"}, {"env": {"name": "feedback"}},
             "^env.name: a setting of the env episodes, but the run's episodes are 'agent' \\(rollout.episodes\\)"),
            ({"name": ""}, {}, "^agent.name: rollout.episodes agent needs an agent"),
            ({"name": f"{AGENTS}:two_calls"}, {"proxy": {"max_calls": 0}}, "^proxy.max_calls: expected >= 1"),
            ({"name": f"{AGENTS}:two_calls"}, {"proxy": {"port": 70000}}, "^proxy.port")]:
        with pytest.raises(ValueError, match=match):
            trainer_module.Trainer(smoke_config(tmp_path, rollout={"episodes": "agent"}, agent=agent, **extra), tmp_path)


def test_vllm_through_the_proxy_records_mu_and_its_topk_on_generated_tokens(tmp_path, tokenizer, make_tiny_model):
    pytest.importorskip("vllm")
    from dppo.rollout.vllm import VLLMEngine
    from dppo.runtime.models import save_model

    model = make_tiny_model(seed=0, num_heads=2, num_kv_heads=1)  # (vLLM's CPU attention: head size >= 32)
    path = save_model(model, tokenizer, tmp_path / "m")
    with VLLMEngine(path, tokenizer, seed=0, max_logprobs=20, kv_cache_gb=0.25) as engine:
        rows = collect("scripted", engine, examples=EXAMPLES[:1], p=params(n=2), max_tokens=200)
    batch = collate(rows, pad_id=0)
    ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                    topk_ids=batch.rollout_topk_ids)
    gen = batch.loss_mask
    assert (~gen & batch.response_mask).any() and all(r.episode.turns == 3 for r in rows)
    assert torch.allclose(ref.logp[gen], batch.rollout_logp[gen], rtol=0, atol=1e-4)
    valid = batch.rollout_topk_valid & gen[..., None]
    assert torch.allclose(ref.topk_logp[valid], batch.rollout_topk_logp[valid], rtol=0, atol=1e-4)


def test_messages_the_chat_template_cannot_render_are_refused_not_a_server_error(model, tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{%- for m in messages -%}{%- if m.role == 'tool' -%}{{ raise_exception('no tool role') }}"
                         "{%- endif -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor -%}"
                         "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
    proxy = Proxy(ProxySettings(max_tokens=128))
    proxy.start()
    try:
        proxy.begin(HFEngine(model, tok), params())
        ep = proxy.open(0, EXAMPLES[0])
        answer = httpx.post(f"{proxy.base_url(ep)}/chat/completions",
                            json={"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]})
        assert answer.status_code == 400 and "no tool role" in answer.json()["error"]["message"]
        assert answer.json()["error"]["param"] == "messages"
    finally:
        proxy.stop()


def test_a_call_past_its_rows_token_budget_is_refused_and_the_episode_counted_truncated(model, tokenizer):
    rows = collect("two_calls", HFEngine(model, tokenizer), p=params(n=1), max_tokens=12)
    assert len(rows) == 2
    for r in rows:  # the first call fits; the second ("again" rendered after it) would pass 12 response tokens
        assert r.episode.turns == 1 and r.episode.truncated == 1.0 and r.finish_reason == "length"
        assert "context_length_exceeded" in r.episode.error or "proxy.max_tokens" in r.episode.error
        assert r.episode.refused_calls == 1.0


def test_evaluation_reports_the_episodes_that_failed(tmp_path, capsys):
    """Held-out episodes whose agent failed score 0: evaluation says how many, so a pass@1 of failures is not read as
    the policy's."""
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"episodes": "agent", "max_new_tokens": 4},
                       agent={"name": f"{AGENTS}:raises"}, proxy={"max_tokens": 64},
                       task={"eval_size": 3}, train={"threads": 1, "eval_samples_per_prompt": 2})
    with Trainer(cfg, tmp_path) as trainer:
        result = trainer.evaluate_and_log()
    assert result["n"] == 6 and result["episode_failures"] == 6 and "episode_timeouts" not in result
    assert "6 failures (scored 0)" in capsys.readouterr().out


@pytest.mark.parametrize("region", ["dppo_binary_tv", "dppo_topk_tv"])
def test_a_clients_top_logprobs_is_answered_in_training_and_in_evaluation(tmp_path, region):
    """SkyRL's default `top_logprobs: 1`: an agent run records µ's top-1 by default (K = 1 under Binary-TV; a Top-K
    region's 20), and evaluation episodes record the run's K too (they recorded none: every one was refused)."""
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"episodes": "agent", "engine": "hf", "dtype": "float32", "max_new_tokens": 3,
                                          "prompts_per_step": 2, "group_size": 2},
                       agent={"name": f"{AGENTS}:asks_top_logprobs"}, proxy={"max_tokens": 64},
                       loss={"trust_region": region},
                       task={"eval_size": 2}, train={"threads": 1, "eval_samples_per_prompt": 1})
    assert cfg.top_k_logprobs == (1 if region == "dppo_binary_tv" else 20)
    with Trainer(cfg, tmp_path) as trainer:
        metrics = trainer.step()
        result = trainer.evaluate()
    assert metrics["reward/mean"] == 1.0 and metrics["episode/env_errors"] == 0
    assert result["n"] == 2 and result["reward_mean"] == 1.0 and "episode_failures" not in result

"""Multi-turn episodes (`dppo.episodes.env_loop`) against obviously-correct references: the ids are the chat template's
transcript, µ (and µ's top-K) on every generated token is the sampling distribution of the weights that sampled it,
the trainer's π equals a plain forward over the whole sequence, environment tokens get exactly zero gradient and
count in no denominator; the environment's failures are contained; every sampling mode runs the same episodes; a single
answer is a one-turn episode (`SingleAnswer`: one engine call and one reward call per batch).

The test environments live in tests/data/scripted_env.py and are loaded by file path, as a user's are.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from pathlib import Path

import pytest
import torch

from dppo.envs import ENVIRONMENTS, make_environment
from dppo.episodes.chat import ChatCodec
from dppo.episodes.env_loop import EnvCollector
from dppo.episodes.results import episode_rewards
from dppo.episodes.settings import EnvSettings
from dppo.episodes.single import SingleAnswer, engine_prompts
from dppo.example import Example
from dppo.losses import LOSSES, loss_spec
from dppo.rollout.base import SamplingParams
from dppo.rewards.runner import NonFiniteRewardError, RewardRunner
from dppo.rollout.hf import HFEngine
from dppo.train.batch import collate
from dppo.train.scoring import score_responses, score_responses_reference

ENVS = Path(__file__).resolve().parents[1] / "data" / "scripted_env.py"
SCRIPTED = f"{ENVS}:Scripted"
EXAMPLES = [Example(prompt=({"role": "user", "content": "2+3?"},), answer="5"),
            Example(prompt=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "17*3?"}), answer="51")]
K = 4
THREE_TURNS = EnvSettings(SCRIPTED, '{"turns": 3}', max_turns=3, max_tokens=200)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"n": 2, "max_new_tokens": 6, "top_k_logprobs": K, "stop_token_ids": (1,), "seed": 3, **kw})


@pytest.fixture(scope="module")
def model(tiny_model, with_logit_bias):
    """The tiny model, never sampling pad / <|im_start|> / unk (so decoded replies are the sampled text), and
    stopping often enough that some turns end with <|im_end|> and others are cut by max_new_tokens."""
    return with_logit_bias(tiny_model, {0: -40.0, 2: -40.0, 3: -40.0, 1: 2.0})


def _episodes(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    return EnvCollector(THREE_TURNS)(engine, EXAMPLES, params())


@pytest.fixture(scope="module")
def episodes(model, tokenizer):
    """Episodes of the biased model (readable transcripts, both kinds of turn end)."""
    return _episodes(model, tokenizer)


@pytest.fixture(scope="module")
def plain(tiny_model, tokenizer):
    """Episodes of the plain tiny model (the trainer's scoring needs a bias-free lm-head; its turns are all cut by
    max_new_tokens, so every turn has an inserted end of turn)."""
    return _episodes(tiny_model, tokenizer)


def test_ids_are_the_chat_templates_transcript_and_only_sampled_tokens_are_trained(episodes, tokenizer):
    codec = ChatCodec(tokenizer)
    assert tokenizer.decode(codec.boundary(codec.base)) == "\n"
    assert len(episodes) == 4 and [r.prompt_index for r in episodes] == [0, 0, 1, 1]
    cut = 0
    for r in episodes:
        messages = r.episode.messages
        assert [m["role"] for m in messages][-5:] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert r.episode.turns == 3 and r.finish_reason == "eos" and r.reward is not None
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = torch.cat([r.prompt_ids, r.response_ids]).tolist()
        # up to the final end of turn: the boundary (and the stop token, when the last turn was cut) ends no turn
        tail = "\n" if ids[-1] == tokenizer.eos_token_id else "<|im_end|>\n"
        assert tokenizer.decode(ids) + tail == rendered
        # environment tokens: exactly the template's tool turns (and an end-of-turn the engine did not sample)
        env = r.response_ids[~r.loss_mask].tolist()
        assert tokenizer.decode(env).replace("<|im_end|>", "").count("<|im_start|>tool\nresult") == 2
        cut += r.episode.turns_truncated
        assert r.episode.env_tokens == float((~r.loss_mask).sum())
        assert torch.equal(r.rollout_logp[~r.loss_mask], torch.zeros(int((~r.loss_mask).sum())))
        assert not r.rollout_topk_valid[~r.loss_mask].any()
        assert r.rollout_topk_valid[r.loss_mask][:, :K].all()
        assert r.turn_index.tolist() == sorted(r.turn_index.tolist()) and set(r.turn_index.tolist()) == {0, 1, 2}
    assert 0 < cut < 12  # both kinds of turn end occurred: the stop token and the max_new_tokens cut


def test_a_turn_ended_by_another_stop_token_still_gets_the_templates_end_of_turn(model, tokenizer):
    stops = tuple(tokenizer.convert_tokens_to_ids(list("0123456789aeiou")))
    rollouts = EnvCollector(THREE_TURNS)(
        HFEngine(model, tokenizer), EXAMPLES, params(stop_token_ids=(1,) + stops, max_new_tokens=12))
    other = 0
    for r in rollouts:
        ids = torch.cat([r.prompt_ids, r.response_ids]).tolist()
        tail = "\n" if ids[-1] == tokenizer.eos_token_id else "<|im_end|>\n"
        assert tokenizer.decode(ids) + tail == tokenizer.apply_chat_template(r.episode.messages, tokenize=False)
        other += sum(int(t) in stops for t in r.response_ids[r.loss_mask])
    assert other > 0  # some turns really ended on a stop id that is not the EOS


def test_mu_and_its_topk_are_the_sampling_distribution_and_the_trainers_pi_is_a_plain_forward(plain, tiny_model):
    model, batch = tiny_model, collate(plain, pad_id=0)
    ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                    topk_ids=batch.rollout_topk_ids)
    gen = batch.loss_mask
    assert torch.allclose(ref.logp[gen], batch.rollout_logp[gen], rtol=0, atol=2e-5)
    valid = batch.rollout_topk_valid & gen[..., None]
    assert torch.allclose(ref.topk_logp[valid], batch.rollout_topk_logp[valid], rtol=0, atol=2e-5)
    for layout in ("packed", "shared"):  # the trainer's scoring, every response position
        got = score_responses(model, batch.prompt_ids, batch.response_ids, batch.response_mask, layout=layout)
        assert torch.allclose(got.logp[batch.response_mask], ref.logp[batch.response_mask], rtol=0, atol=2e-5)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_environment_tokens_get_exactly_zero_gradient_and_count_in_no_denominator(plain, tiny_model, aggregation):
    model, batch = tiny_model, collate(plain, pad_id=0)
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0])
    logp = score_responses(model, batch.prompt_ids, batch.response_ids, batch.response_mask).logp
    logp = logp.detach().requires_grad_(True)
    spec = loss_spec(trust_region="dppo_binary_tv", aggregation=aggregation)
    loss, stats = LOSSES["masked_is"](logp, batch.rollout_logp, adv, batch.loss_mask, spec)
    (grad,) = torch.autograd.grad(loss, logp)
    env = batch.response_mask & ~batch.loss_mask
    assert env.any() and torch.equal(grad[env], torch.zeros(int(env.sum())))
    assert (grad[batch.loss_mask] != 0).all()
    # a hand computation over generated tokens only: ℓ_t = −Â·sg(π/µ)·log π (π = µ before any update: all kept)
    lp = logp.detach()
    terms = [[-float(adv[b]) * float((lp[b, t] - batch.rollout_logp[b, t]).exp()) * float(lp[b, t])
              for t in range(lp.shape[1]) if batch.loss_mask[b, t]] for b in range(4)]
    hand = {"token-mean": sum(map(sum, terms)) / sum(map(len, terms)),
            "seq-mean-token-mean": sum(sum(s) / len(s) for s in terms) / 4,
            "seq-mean-token-sum": sum(map(sum, terms)) / 4}[aggregation]
    assert float(loss) == pytest.approx(hand, rel=1e-6)
    assert float(stats["n_tokens"]) == float(batch.loss_mask.sum())
    # whatever sits under the environment tokens (µ, π) cannot reach the loss
    poisoned = batch.rollout_logp.masked_fill(env, 7.0)
    again, _ = LOSSES["masked_is"](logp.masked_fill(env, -50.0), poisoned, adv, batch.loss_mask, spec)
    assert float(again) == float(loss)


def test_vllm_records_mu_on_generated_tokens_from_token_ids(tmp_path, tokenizer, make_tiny_model):
    pytest.importorskip("vllm")
    from dppo.rollout.vllm import VLLMEngine
    from dppo.runtime.models import save_model

    model = make_tiny_model(seed=0, num_heads=2, num_kv_heads=1)  # (vLLM's CPU attention: head size >= 32)
    path = save_model(model, tokenizer, tmp_path / "m")
    with VLLMEngine(path, tokenizer, seed=0, max_logprobs=20, kv_cache_gb=0.25) as engine:
        rollouts = EnvCollector(THREE_TURNS)(
            engine, EXAMPLES[:1], params())
    batch = collate(rollouts, pad_id=0)
    ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                    topk_ids=batch.rollout_topk_ids)
    gen = batch.loss_mask
    assert (~gen & batch.response_mask).any()
    assert torch.allclose(ref.logp[gen], batch.rollout_logp[gen], rtol=0, atol=1e-4)
    valid = batch.rollout_topk_valid & gen[..., None]
    assert torch.allclose(ref.topk_logp[valid], batch.rollout_topk_logp[valid], rtol=0, atol=1e-4)
    assert not batch.rollout_topk_valid[~gen].any()


# --- a single answer: a one-turn episode -----------------------------------------------------------------------


class _CountingRunner(RewardRunner):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.calls: list[int] = []

    def __call__(self, completions, examples):
        self.calls.append(len(completions))
        return super().__call__(completions, examples)


def test_a_single_answer_is_a_one_turn_episode_one_engine_call_and_one_reward_call(model, tokenizer):
    """SingleAnswer samples the whole batch in ONE `generate` (params.n per prompt, the engine's own prompts:
    chat messages as they are, raw text as ids) and scores it in ONE reward-runner call; each rollout's record holds
    its decoded answer and its reward's failure or timeout."""
    examples = [*EXAMPLES, Example(prompt="raw 1+1=", answer="hang")]

    def reward(completion, example):
        if example.answer == "51":
            raise RuntimeError("the reward broke")
        if example.answer == "hang":
            time.sleep(2.0)
        return 1.0 + len(completion)

    engine = HFEngine(model, tokenizer)
    calls, generate = [], engine.generate
    engine.generate = lambda prompts, p: calls.append((prompts, p)) or generate(prompts, p)
    env = SingleAnswer(6, reward=_CountingRunner(reward, isolation="thread", timeout_s=0.5))
    rollouts = env.collector()(engine, examples, params())
    assert env.max_turns == 1 and env.max_tokens == 6
    assert calls == [(engine_prompts(examples, tokenizer), params())]
    assert isinstance(calls[0][0][2][0], int)  # (raw text: token ids, no template)
    direct = generate(engine_prompts(examples, tokenizer), params())  # the same call, bitwise
    assert all(torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logp, b.rollout_logp)
               for a, b in zip(rollouts, direct))
    assert all(r.reward is None for r in rollouts)  # collected, not yet scored
    env.score(examples, rollouts)
    assert env.reward.calls == [6]
    for r in rollouts:
        text = tokenizer.decode(r.response_ids.tolist(), skip_special_tokens=True)
        answer = examples[r.prompt_index].answer
        assert r.episode.completion == text and r.episode.turns == 1.0 and r.episode.messages == []
        assert r.loss_mask is None and r.turn_index is None  # every token sampled, one turn: no per-turn metrics
        assert r.reward == {"5": 1.0 + len(text), "51": 0.0, "hang": 0.0}[answer]
        assert (r.episode.env_errors, r.episode.env_timeouts) == {"5": (0, 0), "51": (1, 0), "hang": (0, 1)}[answer]
    rewards, stats = episode_rewards(rollouts)
    assert rewards.tolist() == [r.reward for r in rollouts] and stats == {"failures": 2, "timeouts": 2}
    assert env.metrics(rollouts) == {} and env.check(examples[0]) is None  # no episode/* keys for single answers


def test_a_single_turn_env_travels_without_its_reward_and_a_nan_reward_is_refused(model, tokenizer):
    env = SingleAnswer(4, reward=RewardRunner(lambda c, e: float("nan"), isolation="none"))
    copy = pickle.loads(pickle.dumps(env))
    assert copy.reward is None and copy.max_tokens == 4 and repr(copy) == repr(env) == "SingleAnswer(max_tokens=4)"
    rollouts = copy.collector()(HFEngine(model, tokenizer), EXAMPLES[:1], params(n=1))
    with pytest.raises(RuntimeError, match="no reward runner"):
        copy.score(EXAMPLES[:1], rollouts)
    with pytest.raises(NonFiniteRewardError):
        env.score(EXAMPLES[:1], rollouts)
    with pytest.raises(ValueError, match="not scored"):
        episode_rewards(rollouts)


# --- budgets and failures --------------------------------------------------------------------------------------


def _run(model, tokenizer, env: str, options: dict | None = None, **limits):
    settings = EnvSettings(env, json.dumps(options or {}), **limits)
    return EnvCollector(settings)(HFEngine(model, tokenizer), EXAMPLES[:1], params(n=1))


def test_an_episode_over_its_budgets_is_truncated_not_an_error(model, tokenizer):
    short = _run(model, tokenizer, SCRIPTED, options={"turns": 9}, max_turns=2, max_tokens=200)[0]
    assert short.episode.turns == 2 and short.finish_reason == "length" and short.episode.truncated == 1.0
    tight = _run(model, tokenizer, SCRIPTED, options={"turns": 9}, max_turns=9, max_tokens=20)[0]
    assert tight.response_ids.numel() <= 20 and tight.finish_reason == "length"
    assert tight.loss_mask[-1]  # an episode ends on a generated token, never on an environment answer


@pytest.mark.parametrize("env, counter, message", [
    ("Raises", "env_errors", "RuntimeError: the environment broke"),
    ("Hangs", "env_timeouts", "timed out after 0.5s"),
    ("NotAMessage", "env_errors", "returned dict, expected an EnvStep"),
])
def test_an_environment_that_raises_hangs_or_returns_garbage_is_contained_and_named(model, tokenizer, env, counter,
                                                                                      message):
    r = _run(model, tokenizer, f"{ENVS}:{env}", max_turns=3, max_tokens=100, timeout_s=0.5)[0]
    assert getattr(r.episode, counter) == 1.0 and r.episode.turns == 1 and r.reward == 0.0
    assert message in r.episode.error and f"{ENVS}:{env}" in r.episode.error


def test_each_episodes_environment_is_closed_once_however_it_ends(model, tokenizer):
    from dppo.envs import environment_class

    closed = environment_class(f"{ENVS}:Closes").closed
    for options, limits, finish in [({"turns": 2}, {}, "eos"), ({"turns": 9}, {"max_turns": 2}, "length"),
                                    ({"fail": "step"}, {}, "eos")]:
        closed.clear()
        [r] = _run(model, tokenizer, f"{ENVS}:Closes", options, **{"max_turns": 3, "max_tokens": 100, **limits})
        assert r.finish_reason == finish and len(closed) == 1, (options, closed)
    closed.clear()
    with pytest.raises(ValueError, match="reset\\(\\) failed"):
        _run(model, tokenizer, f"{ENVS}:Closes", {"fail": "reset"}, max_turns=3, max_tokens=100)
    assert len(closed) == 1


def test_bad_environment_settings_fail_before_any_model_loads(tmp_path, monkeypatch):
    from conftest import smoke_config
    from dppo.train import trainer as trainer_module

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer_module, "build_model", no_model)
    for env, match in [({"name": "nope"}, "unknown environment 'nope'"),
                       ({"name": "feedback", "options": '{"decay": 3}'}, "decay: expected in"),
                       ({"name": "calculator", "options": '{"colour": 1}'}, "colour"),
                       ({"name": f"{ENVS}:BadReset"}, "reset\\(\\) returned str"),
                       ({"name": "feedback", "options": "[1]"}, "^env.options: expected a JSON object"),
                       ({"name": "feedback", "options": "{x"}, "^env.options: not valid JSON"),
                       ({"name": "feedback", "max_turns": 0}, "^env.max_turns: expected >= 1"),
                       ({"name": "feedback", "max_tokens": 4}, "^rollout.max_new_tokens: 6 \\(one turn\\) > env.max_tokens")]:
        with pytest.raises(ValueError, match=match):
            trainer_module.Trainer(smoke_config(tmp_path, rollout={"episodes": "env"}, env=env), tmp_path)
    with pytest.raises(ValueError, match=r"^env\.name: rollout\.episodes env needs an environment"):
        trainer_module.Trainer(smoke_config(tmp_path, rollout={"episodes": "env"}), tmp_path)
    with pytest.raises(ValueError, match=r"^env\.name: a setting of the env episodes, but the run's episodes are "
                                         r"'single' \(rollout\.episodes\)$"):
        smoke_config(tmp_path, env={"name": "feedback"})


def test_user_environment_from_a_file_and_the_builtins_are_registered():
    assert set(ENVIRONMENTS) == {"calculator", "python", "feedback", "mcp", "openenv"}  # (tests/envs: mcp, openenv)
    env = make_environment(SCRIPTED, turns=2)()
    env.reset(EXAMPLES[0])
    assert env.step("a1").messages == ({"role": "tool", "content": "result 1"},)
    last = env.step("2")  # the second turn ends it, rewarded with the digits written
    assert last.done and last.reward == 2.0 and last.messages == ()
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        make_environment(f"{ENVS}:Missing")


# --- the trainer, in every sampling mode ---------------------------------------------------------------------------

MODES = {"sync": {}, "lagged": {"engine_lag": 1},
         "async": {"mode": "async", "max_staleness": 1, "worker_threads": 1, "worker_timeout_s": 60.0}}


def check_mu_is_the_sampling_versions(trainer) -> set[int]:
    """For every batch a `test_async._Recording` trainer trained: environment tokens are there but not trained, and
    µ on every generated token is the fp32 distribution of the published version that sampled it. Returns the
    staleness values seen (the trainer's weights are put back)."""
    model = trainer.model
    live = {n: p.detach().clone() for n, p in model.state_dict().items()}
    stale = set()
    for step, batch in trainer.batches:
        assert (batch.response_mask & ~batch.loss_mask).any()
        for version in batch.weight_version.unique().tolist():
            stale.add(step - version)
            rows = (batch.weight_version == version).nonzero().squeeze(1)
            model.load_state_dict(trainer.versions[version])
            with torch.no_grad():
                ref = score_responses_reference(model, [batch.prompt_ids[i] for i in rows.tolist()],
                                                batch.response_ids[rows].cpu(), batch.response_mask[rows].cpu())
            gen = batch.loss_mask[rows].cpu()
            assert torch.allclose(ref.logp[gen], batch.rollout_logp[rows].cpu()[gen], rtol=0, atol=2e-5)
    model.load_state_dict(live)
    return stale


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_runs_episodes_in_every_mode_and_mu_is_the_sampling_versions(tmp_path, mode):
    """µ on every generated token equals the fp32 distribution of the published version that sampled it, in sync,
    lagged and async modes; environment tokens are outside the loss; the step reports the per-turn metrics."""
    from conftest import smoke_config
    from test_async_source import _Recording

    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "dtype": "float32", "max_new_tokens": 4, **MODES[mode]},
                       env={"name": SCRIPTED, "options": '{"turns": 3}', "max_turns": 3, "max_tokens": 120},
                       train={"threads": 1, "steps": 3, "mini_batches": 1})
    trainer = _Recording(cfg, tmp_path)
    try:
        metrics = [trainer.step() for _ in range(3)]
        stale = check_mu_is_the_sampling_versions(trainer)
    finally:
        trainer.close()
    assert stale == ({0} if mode == "sync" else {0, 1})
    last = metrics[-1]
    assert last["episode/turns_mean"] == 3.0 and last["episode/tool_calls_mean"] == 2.0
    assert 0 < last["episode/env_token_frac"] < 1
    for j in range(3):
        assert f"mismatch/binary_tv_turn_{j}" in last and f"trust_region/masked_frac_turn_{j}" in last
        assert last[f"rollout/staleness_turn_{j}"] == (0.0 if mode == "sync" else 1.0)
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)
    samples = (tmp_path / "samples.jsonl").read_text()
    assert "<tool [env]> result 1" in samples


@pytest.mark.parametrize("region", sorted(__import__("dppo.trust_region", fromlist=["x"]).TRUST_REGIONS))
def test_every_trust_region_trains_on_episodes(tmp_path, region):
    """Each registered trust region (Top-K ones with µ's cells across turns) takes a finite step on episodes, every
    trained parameter moves, and the masked share counts generated tokens only."""
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "max_new_tokens": 4}, loss={"trust_region": region, **({"relax_alpha": 0.1} if region == "ppo_clip_relax" else {})},
                       env={"name": SCRIPTED, "options": '{"turns": 2}', "max_turns": 2, "max_tokens": 80},
                       train={"threads": 1, "steps": 1, "mini_batches": 1, "epochs": 2})
    with Trainer(cfg, tmp_path) as trainer:
        before = [p.detach().clone() for p in trainer.params]
        m = trainer.step()
        assert all(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.params))
    assert torch.isfinite(torch.tensor(m["loss/policy"])) and 0 <= m["trust_region/masked_frac"] <= 1
    assert m["episode/turns_mean"] == 2.0


@pytest.mark.parametrize("name", sorted(set(ENVIRONMENTS) - {"mcp", "openenv"}))  # (a server's; no demonstration)
def test_each_builtin_replays_its_demonstration_to_full_reward(name):
    """The transcript `dppo sft` trains on is what the environment really answers, and it earns reward 1."""
    from dppo.tasks import make_task

    for example in make_task("chain_sum", size=3, eval_size=1, min_terms=4, max_terms=4, min_digits=3,
                             max_digits=3).train:
        env = make_environment(name)()
        env.reset(example)
        demo = env.demonstration(example)
        replies = [m for m in demo if m["role"] == "assistant"]
        answers = [m for m in demo if m["role"] != "assistant"]
        got, reward = [], 0.0
        for reply in replies:
            step = env.step(reply["content"])
            got += list(step.messages)
            reward += step.reward
        assert step.done and reward == 1.0 and got == answers


def test_tool_errors_are_answers_and_counted():
    env = make_environment("calculator")()
    env.reset(EXAMPLES[0])
    step = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "__import__(1)"}}</tool_call>'
                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad json</tool_call>')
    assert not step.done and len(step.messages) == 3 and all(m["role"] == "tool" for m in step.messages)
    assert step.info["tool_calls"] == 3.0 and step.info["tool_errors"] == 3.0
    assert env.step("The answer is 5").reward == 1.0


def test_in_flight_updates_episodes_span_versions_and_each_token_names_its_own(tmp_path):
    """Async workers with in-flight updates: new weights arrive between decode chunks and between turns, so later
    turns of an episode may be sampled by newer weights; µ of each generated token is that of the version it names,
    and the episode counts as old as its oldest token."""
    from conftest import smoke_config
    from test_async_source import _Recording

    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "dtype": "float32", "max_new_tokens": 16, "mode": "async", "max_staleness": 1,
                                          "worker_threads": 1, "worker_timeout_s": 60.0, "in_flight_updates": True},
                       env={"name": SCRIPTED, "options": '{"turns": 4}', "max_turns": 4, "max_tokens": 200},
                       train={"threads": 1, "steps": 4, "mini_batches": 1})
    trainer = _Recording(cfg, tmp_path)
    try:
        for _ in range(4):
            trainer.step()
        model, live = trainer.model, {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
        spans = 0
        for step, batch in trainer.batches:
            versions, gen = batch.token_version.cpu(), batch.loss_mask.cpu()
            oldest = torch.where(gen, versions, torch.full_like(versions, 1 << 40)).amin(-1)
            assert torch.equal(oldest, batch.weight_version.cpu()) and int((step - oldest).max()) <= 1
            spans += int(sum(len(set(v[g].tolist())) > 1 for v, g in zip(versions, gen)))
            for version in versions[gen].unique().tolist():
                model.load_state_dict(trainer.versions[version])
                with torch.no_grad():
                    ref = score_responses_reference(model, batch.prompt_ids, batch.response_ids.cpu(),
                                                    batch.response_mask.cpu())
                at = gen & (versions == version)
                assert torch.allclose(ref.logp[at], batch.rollout_logp.cpu()[at], rtol=0, atol=2e-5)
        model.load_state_dict(live)
    finally:
        trainer.close()
    print(f"episodes spanning versions: {spans}")


def test_the_hf_engines_prefix_cache_prefills_only_new_tokens_and_changes_nothing(tiny_model, tokenizer, monkeypatch):
    """Episodes turn on the hf engine's prefix cache: later turns run only their new tokens through the model, and
    every sampled id and µ equals a run without the cache (per turn: the same seed, the same distribution)."""
    fed = {"on": 0, "off": 0}
    runs = {}
    for mode in ("on", "off"):
        engine = HFEngine(tiny_model, tokenizer)
        if mode == "off":
            engine.enable_prefix_cache = lambda max_tokens: None  # (an engine without the cache: a no-op)
        forward = engine.model.forward

        def counting(*a, input_ids=None, mode=mode, **k):
            fed[mode] += int(input_ids.numel())
            return forward(*a, input_ids=input_ids, **k)

        monkeypatch.setattr(engine.model, "forward", counting)
        settings = EnvSettings(SCRIPTED, '{"turns": 4}', max_turns=4, max_tokens=300)
        runs[mode] = EnvCollector(settings)(engine, EXAMPLES, params(max_new_tokens=8))
        assert engine._prefix is None  # off again after the episodes
    for a, b in zip(runs["on"], runs["off"]):
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.allclose(a.rollout_logp, b.rollout_logp, rtol=0, atol=2e-5)
    print(fed)
    assert fed["on"] < 0.6 * fed["off"], fed


def test_new_weights_clear_the_prefix_cache(tiny_model, make_tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    engine.enable_prefix_cache(10_000)
    first = engine.generate([[5, 6, 7]], params(n=1))[0]
    assert engine._prefix.entries
    engine.load_weights(make_tiny_model(seed=1).state_dict())
    assert not engine._prefix.entries
    again = engine.generate([[5, 6, 7] + first.response_ids.tolist() + [9]], params(n=1))[0]
    fresh = HFEngine(make_tiny_model(seed=1), tokenizer).generate([[5, 6, 7] + first.response_ids.tolist() + [9]],
                                                                   params(n=1))[0]
    assert torch.equal(again.response_ids, fresh.response_ids)
    assert torch.allclose(again.rollout_logp, fresh.rollout_logp, rtol=0, atol=2e-5)


def test_per_turn_metrics_of_turns_no_episode_reached_are_left_out(tmp_path):
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "max_new_tokens": 4},
                       env={"name": SCRIPTED, "options": '{"turns": 2}', "max_turns": 4, "max_tokens": 80},
                       train={"threads": 1, "steps": 1})
    with Trainer(cfg, tmp_path) as trainer:
        m = trainer.step()
    assert {f"mismatch/binary_tv_turn_{j}" for j in range(4)} & set(m) == {"mismatch/binary_tv_turn_0",
                                                                          "mismatch/binary_tv_turn_1"}
    assert "trust_region/masked_frac_turn_2" not in m and not any(k.startswith("count/") for k in m)


@pytest.mark.parametrize("reward, verdict, succeeded", [(0.25, True, True), (2.0, False, False), (0.25, None, False),
                                                        (1.0, None, True)])
def test_success_is_the_environments_verdict_else_reward_1_in_training_and_evaluation_alike(
        model, tokenizer, tmp_path, reward, verdict, succeeded):
    """pass@1 and reward/accuracy are one quantity (`episode_success`): the environment's own verdict
    (EnvStep.info["success"]) where it gives one, else reward >= 1; the mean reward is reported beside it. (Before,
    an episode earning 0.25 on a right answer was a failure and an environment could not say otherwise.)"""
    import json as _json

    from conftest import smoke_config
    from dppo.episodes.results import episode_success
    from dppo.train.trainer import Trainer

    options = _json.dumps({"reward": reward, "success": verdict})
    rollouts = _run(model, tokenizer, f"{ENVS}:Verdict", options=_json.loads(options), max_turns=1, max_tokens=80)
    if verdict is None:
        assert math.isnan(rollouts[0].episode.success)
    else:
        assert rollouts[0].episode.success == float(verdict)
    assert episode_success(rollouts, torch.tensor([reward])).tolist() == [succeeded]
    cfg = smoke_config(tmp_path, rollout={"episodes": "env"}, env={"name": f"{ENVS}:Verdict", "options": options, "max_turns": 1, "max_tokens": 80},
                       train={"threads": 1, "steps": 1, "mini_batches": 1})
    with Trainer(cfg, tmp_path) as trainer:
        m = trainer.step()
        ev = trainer.evaluate()
    assert (m["reward/accuracy"], m["reward/mean"]) == (float(succeeded), reward)
    assert (ev["pass@1"], ev["reward_mean"]) == (float(succeeded), reward)


def test_topk_mismatch_is_reported_per_turn_and_samples_count_mus_cells_per_turn(tmp_path):
    """With µ's top-K recorded (a Top-K trust region), each turn j has its own `mismatch/topk_tv_turn_<j>` beside
    the binary one (the step's `mismatch/topk_tv_mean` lies between them: a token-weighted mean), and each episode in
    samples.jsonl says per turn how many generated tokens carry µ's cells — all of them, on every turn."""
    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    cfg = smoke_config(tmp_path, rollout={"episodes": "env", "dtype": "bfloat16", "max_new_tokens": 4}, loss={"trust_region": "dppo_topk_tv"},
                       env={"name": SCRIPTED, "options": '{"turns": 3}', "max_turns": 3, "max_tokens": 120},
                       train={"threads": 1, "steps": 1, "mini_batches": 1}, log={"samples_per_step": 4})
    with Trainer(cfg, tmp_path) as trainer:
        m = trainer.step()
    per_turn = [m[f"mismatch/topk_tv_turn_{j}"] for j in range(3)]
    assert all(v > 0 for v in per_turn) and all(f"mismatch/binary_tv_turn_{j}" in m for j in range(3))
    assert min(per_turn) - 1e-7 <= m["mismatch/topk_tv_mean"] <= max(per_turn) + 1e-7, (per_turn, m)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        ep = row["episode"]
        assert ep["turns"] == 3 and ep["topk_cells_per_turn"] == ep["generated_tokens_per_turn"]
        assert all(n > 0 for n in ep["generated_tokens_per_turn"])


def test_evaluation_reports_pass_at_k_per_example():
    """With n samples per example, evaluation reports the unbiased pass@k for k = 2, 4, ..., n over each example's
    own successes: an environment that succeeds exactly on the examples with an even answer gives, for every k, the
    share of such examples (a count pooled across examples would not)."""
    import tempfile

    from conftest import smoke_config
    from dppo.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = smoke_config(tmp, rollout={"episodes": "env"}, env={"name": f"{ENVS}:EvenAnswer", "max_turns": 1, "max_tokens": 80},
                           train={"threads": 1, "eval_samples_per_prompt": 8})
        with Trainer(cfg, tmp) as trainer:
            ev = trainer.evaluate()
            even = sum(int(ex.answer) % 2 == 0 for ex in trainer.eval_examples) / len(trainer.eval_examples)
    assert 0 < even < 1 and ev["n"] == 8 * len(trainer.eval_examples)
    for k in (1, 2, 4, 8):
        assert ev[f"pass@{k}"] == pytest.approx(even, abs=1e-12), (k, ev)
    assert "pass@16" not in ev

"""Agent SFT (dppo.train.sft): its transcripts have the episode runner's layout, its loss is the token mean
over the assistant's tokens only, it learns the calculator's demonstrations, and `dppo sft` writes a model folder
that loads by path."""

from __future__ import annotations

import json

import pytest
import torch

from dppo.envs import make_environment
from dppo.envs.tools import render_messages_with_tools, tool_schema
from dppo.episodes.chat import ChatCodec
from dppo.train.sft import (agent_sft, build_transcript, build_transcripts, collate_transcripts, save_model,
                            transcript_loss)

ENVS = ("calculator", "python", "feedback")
SMALL_SUMS = dict(size=24, eval_size=4, min_terms=2, max_terms=3, min_digits=1, max_digits=2)


@pytest.fixture(scope="module")
def examples():
    from dppo.tasks import make_task

    return list(make_task("chain_sum", **SMALL_SUMS).train)[:12]


def _expected_text(tok, env, example) -> str:
    """What the chat template renders for the whole demonstration episode (tools in the system prompt)."""
    first = env.reset(example)
    schemas = [tool_schema(fn) for fn in env.tools]
    messages = first if ChatCodec(tok).tools_in_template else render_messages_with_tools(tok, first, schemas)
    return tok.apply_chat_template(list(messages) + list(env.demonstration(example)), tokenize=False,
                                   tools=schemas if ChatCodec(tok).tools_in_template and schemas else None)


def _check_layout(tok, name, examples):
    factory = make_environment(name)
    delta = ChatCodec(tok)
    boundary = tok.decode(delta.boundary(delta.base))
    for ex in examples[:4]:
        env = factory()
        t = build_transcript(tok, env, ex, delta=delta, name=name)
        built = tok.decode(t.prompt_ids + t.response_ids, skip_special_tokens=False)
        expected = _expected_text(tok, factory(), ex)
        assert expected.endswith(boundary) and built == expected[: len(expected) - len(boundary)], (built, expected)
        # the loss mask covers exactly the assistant turns, each closed by its stop token
        demo = factory().demonstration(ex)
        turns, run = [], []
        for tid, m in zip(t.response_ids, t.loss_mask):
            if m:
                run.append(tid)
            elif run:
                turns.append(run)
                run = []
        turns.append(run)
        assistant = [m["content"] for m in demo if m["role"] == "assistant"]
        assert [tok.decode(r[:-1]) for r in turns] == assistant
        assert all(r[-1] == tok.eos_token_id for r in turns)
        assert len(t.loss_mask) == len(t.response_ids) and len(t.prompt_ids) == len(delta.render(env.reset(ex), [tool_schema(f) for f in env.tools]))


@pytest.mark.parametrize("name", ENVS)
def test_layout_matches_the_chat_template_char_tokenizer(tokenizer, examples, name):
    _check_layout(tokenizer, name, examples)


@pytest.mark.parametrize("name", ENVS)
def test_layout_matches_the_chat_template_smollm2(smollm2_tokenizer, examples, name):
    _check_layout(smollm2_tokenizer, name, examples)


def test_environment_tokens_are_the_episode_runners(tokenizer, examples):
    """The tool answer is laid out as the runner appends it: `ChatCodec.append(tool messages)` (the boundary, then
    the messages), mask 0."""
    env = make_environment("calculator")()
    ex = examples[0]
    t = build_transcript(tokenizer, env, ex)
    demo = env.demonstration(ex)
    delta = ChatCodec(tokenizer)
    first = tokenizer.encode(demo[0]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
    env_ids = delta.append([demo[1]])
    assert env_ids[:len(delta.boundary(delta.base))] == delta.boundary(delta.base)
    assert t.response_ids[: len(first) + len(env_ids)] == first + env_ids
    assert t.loss_mask[: len(first) + len(env_ids)] == [True] * len(first) + [False] * len(env_ids)


def test_no_demonstration_is_an_error(tokenizer, examples):
    class NoDemo:
        tools = ()

        def reset(self, example):
            return [{"role": "user", "content": "hi"}]

        def step(self, reply):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ValueError, match="no demonstration"):
        build_transcript(tokenizer, NoDemo(), examples[0], name="nodemo")


def _hand_loss(model, batch) -> torch.Tensor:
    """Each whole sequence through the model alone; the mean of -log p over mask-1 tokens of the batch."""
    total, count = torch.zeros(()), 0
    for t in batch:
        seq = torch.tensor(t.prompt_ids + t.response_ids)[None]
        logits = model(input_ids=seq).logits[0, len(t.prompt_ids) - 1: -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
        mask = torch.tensor(t.loss_mask)
        total = total - logp[mask].sum()
        count += int(mask.sum())
    return total / count


def test_loss_is_the_token_mean_over_assistant_tokens(tokenizer, make_tiny_model, examples):
    model = make_tiny_model(seed=1, max_position_embeddings=2048)
    batch = build_transcripts(tokenizer, make_environment("calculator"), examples[:3])
    prompts, resp, real, loss_mask = collate_transcripts(batch)
    assert len({tuple(p.tolist()) for p in prompts}) == 1  # the shared tools prompt is scored once
    with torch.no_grad():
        ours, hand = transcript_loss(model, batch), _hand_loss(model, batch)
    torch.testing.assert_close(ours, hand, rtol=1e-4, atol=1e-5)
    # and it is not the mean over every response token (environment tokens included)
    with torch.no_grad():
        logp = torch.cat([-torch.log_softmax(model(input_ids=torch.tensor(t.prompt_ids + t.response_ids)[None])
                                             .logits[0, len(t.prompt_ids) - 1: -1], -1)
                          .gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0] for t in batch])
    assert not torch.allclose(logp.mean(), hand, rtol=1e-3)
    assert 0 < int(loss_mask.sum()) < int(real.sum())


def test_gradient_ignores_the_logits_at_environment_positions(tokenizer, make_tiny_model, examples):
    """d loss / d logits is zero at every position predicting an environment token (mask 0)."""
    model = make_tiny_model(seed=2, max_position_embeddings=2048)
    t = build_transcripts(tokenizer, make_environment("calculator"), examples[:1])[0]
    seq = torch.tensor(t.prompt_ids + t.response_ids)[None]
    logits = model(input_ids=seq).logits[0, len(t.prompt_ids) - 1: -1].float().detach().requires_grad_(True)
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
    mask = torch.tensor(t.loss_mask)
    (-(logp * mask).sum() / mask.sum()).backward()
    assert logits.grad[~mask].abs().max() == 0 and logits.grad[mask].abs().max() > 0
    with torch.no_grad():  # and that is the loss agent_sft trains
        torch.testing.assert_close(transcript_loss(model, [t]), -(logp * mask).sum() / mask.sum(), rtol=1e-4, atol=1e-5)


def test_agent_sft_loss_falls_on_calculator_demonstrations(tokenizer, make_tiny_model, examples):
    model = make_tiny_model(seed=0, max_position_embeddings=2048)
    before = [p.detach().clone() for p in model.parameters()]
    losses = agent_sft(model, tokenizer, make_environment("calculator"), examples, steps=25, batch_size=4, lr=3e-3,
                       seed=0)
    assert len(losses) == 25 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3, losses
    assert not model.training and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_agent_sft_checks_its_arguments(tokenizer, make_tiny_model, examples):
    model = make_tiny_model(seed=0)
    with pytest.raises(ValueError, match="examples"):
        agent_sft(model, tokenizer, make_environment("feedback"), [], steps=1, batch_size=1, lr=1e-3)
    with pytest.raises(ValueError, match="steps"):
        agent_sft(model, tokenizer, make_environment("feedback"), examples, steps=0, batch_size=1, lr=1e-3)


def test_save_model_is_atomic_and_loads_by_path(tokenizer, make_tiny_model, tmp_path):
    from dppo.runtime.models import ModelSpec, load

    model = make_tiny_model(seed=3)
    out = save_model(model, tokenizer, tmp_path / "sft")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]  # no temporary folder left behind
    loaded, tok, path = load(ModelSpec(str(out)))
    ids = torch.tensor([tokenizer.encode("<|im_start|>user\n1+2=<|im_end|>")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert tok.encode("12 + 3") == tokenizer.encode("12 + 3") and tok.chat_template == tokenizer.chat_template
    with pytest.raises(ValueError, match="already exists"):
        save_model(model, tokenizer, out)
    save_model(make_tiny_model(seed=4), tokenizer, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]


def test_cli_sft_writes_a_model_folder_train_can_start_from(tmp_path, capsys):
    from dppo.cli import main
    from dppo.runtime.models import ModelSpec, load

    out = tmp_path / "sft"
    rc = main(["sft", "--preset", "smoke", "--rollout.episodes", "env", "--env.name", "feedback", "--task.name", "chain_sum", "--task.reward", "",
               "--task.options", json.dumps({k: v for k, v in SMALL_SUMS.items() if k not in ("size", "eval_size")}),
               "--task.size", "24", "--task.eval-size", "4", "--out", str(out), "--steps", "2", "--batch-size", "2",
               "--lr", "1e-3", "--log-every", "0"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"dppo train --preset smoke --model.name {out}" in text
    info = json.loads((out / "sft.json").read_text())
    assert info["steps"] == 2 and len(info["losses"]) == 2 and info["env"] == "feedback"
    model, tok, path = load(ModelSpec(str(out)))
    assert path == out and tok.eos_token == "<|im_end|>"
    assert main(["sft", "--preset", "smoke", "--rollout.episodes", "env", "--env.name", "feedback", "--out",
                 str(out)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err
    assert main(["sft", "--preset", "smoke", "--out", str(tmp_path / "other")]) == 2  # no environment
    assert "rollout.episodes: dppo sft trains on an environment's demonstrations" in capsys.readouterr().err

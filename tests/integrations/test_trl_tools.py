"""Top-K trust regions through TRL's tool-calling loop (`tools=`, `environment_factory`, several environments):
DPPOTrainer records µ's top-K cells for every generated token of every turn, and none for tool tokens.

The episode is fixed by a scripted tiny model (`ScriptedTurns`): a forward hook on its decoder stack that, from the
token ids alone, pushes the hidden state towards the next token of a script, so that the first assistant turn is a
tool call, the tool's answer follows, and the second turn is free for a few tokens, then ends. The push is a function
of the ids, applied in every forward (generation and TRL's fused-head training forward alike), so the model's law is
that of the scripted model everywhere, and the recorded cells can be checked against its plain forward. CPU, built in
process; skipped without TRL.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_trl import integ, needs_trl, plain_scaled_logits  # noqa: F401 - integ is a fixture

pytestmark = [needs_trl, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}{% if not loop.last %}, "
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} "
    "| tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A short ChatML template that renders tools, tool calls (Qwen's <tool_call> JSON) and tool messages, and keeps
prefixes (TRL's tool loop needs both)."""
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
FREE = 6  # free tokens of the second turn before it is made to end
K = 4
G = 4
TAU = 0.7
MAX_COMPLETION = 110  # turn 1 (72 tokens) + the tool's answer (21) + turn 2 (<= 7)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class AddEnv:
    """An environment whose one tool is `add`."""

    def reset(self, **kwargs) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


class TimesEnv(AddEnv):
    """A second environment: its `add` multiplies (so its tool answers differ)."""

    def add(self, a: int, b: int) -> int:
        """Add two integers (this environment multiplies them).

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a * b


class ScriptedTurns:
    """A forward hook on a causal LM's decoder stack: at each position, from the ids seen so far, the number of
    assistant headers and the offset since the last one give a target token: the script (`TOOL_CALL` and EOS) in the
    first assistant turn, EOS from offset `FREE` of the second; its hidden state gets strength · w / |w|² added (w =
    the target's output embedding), which raises the target's logit by `strength`. Other positions are untouched."""

    def __init__(self, model, tokenizer, strength: float = 30.0) -> None:
        self.header = torch.tensor(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
        script = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.script = torch.tensor(script)
        self.eos, self.strength, self.head = tokenizer.eos_token_id, strength, model.get_output_embeddings()
        model.base_model.register_forward_hook(self, with_kwargs=True)

    def targets(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L] target token of each position's next token, -1 where free."""
        B, L = ids.shape
        H = len(self.header)
        header_end = torch.zeros(B, L, dtype=torch.bool)
        if L >= H:
            header_end[:, H - 1:] = (ids.unfold(1, H, 1) == self.header).all(-1)
        turn = header_end.cumsum(1)
        pos = torch.arange(L).expand(B, L)
        offset = pos - torch.where(header_end, pos, -1).cummax(1).values
        target = torch.full((B, L), -1)
        first = (turn == 1) & (offset < len(self.script))
        target[first] = self.script[offset[first]]
        target[(turn == 2) & (offset >= FREE)] = self.eos
        return target

    def __call__(self, module, args, kwargs, output):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        target = self.targets(ids.cpu()).to(ids.device)
        w = self.head.weight.detach()[target.clamp(min=0)]
        push = self.strength * w / w.pow(2).sum(-1, keepdim=True).clamp(min=1e-12)
        push = torch.where((target >= 0)[..., None], push, torch.zeros_like(push))
        output.last_hidden_state = output.last_hidden_state + push.to(output.last_hidden_state.dtype)
        return output


@pytest.fixture
def tool_tokenizer():
    from trl.chat_template_utils import qwen3_template

    from dppo.runtime.models import char_tokenizer

    tok = char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    tok.response_template = qwen3_template  # parses <tool_call> JSON (transformers >= 5.13)
    return tok


def final_answer_chars(completions, **_):
    """Reward with spread: distinct characters of the last assistant message (the free second turn)."""
    return [float(len(set(c[-1]["content"]))) for c in completions]


@pytest.fixture
def make_tool_trainer(integ, tool_tokenizer, make_tiny_model, tmp_path):
    """`make_tool_trainer(mode, **config)`: a DPPOTrainer (Top-K TV, K = 4) on a scripted tiny model whose tool loop
    runs through `tools=[add]` ("tools"), `environment_factory=AddEnv` ("environment") or two environments
    ("environments", a dict; rows alternate between them by group)."""
    from datasets import Dataset

    def make(mode: str, rollout_func=None, **overrides):
        settings = dict(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                        learning_rate=1e-2, beta=0.0, num_generations=G, per_device_train_batch_size=8,
                        max_completion_length=MAX_COMPLETION, max_steps=1, logging_steps=1, report_to="none",
                        save_strategy="no", seed=0, disable_tqdm=True, temperature=TAU, lr_scheduler_type="constant",
                        trust_region="dppo_topk_tv", top_k_logprobs=K, generation_kwargs={"use_cache": False})
        settings.update(overrides)
        model = make_tiny_model(seed=0)
        ScriptedTurns(model, tool_tokenizer)
        rows = [{"prompt": [{"role": "user", "content": "What is 2+3?"}]} for _ in range(8)]
        kwargs = {} if rollout_func is None else {"rollout_func": rollout_func}
        if mode == "tools":
            kwargs["tools"] = [add]
        elif mode == "environment":
            kwargs["environment_factory"] = AddEnv
        else:
            kwargs["environment_factory"] = {"add": AddEnv, "times": TimesEnv}
            for i, row in enumerate(rows):
                row["environment"] = "add" if i % 2 == 0 else "times"
        trainer = integ.DPPOTrainer(model=model, reward_funcs=final_answer_chars, args=integ.DPPOConfig(**settings),
                                    train_dataset=Dataset.from_list(rows), processing_class=tool_tokenizer, **kwargs)
        return trainer, rows

    return make


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal values."""
    out = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


@pytest.mark.parametrize("mode", ["tools", "environment", "environments"])
def test_tool_episode_records_cells_of_every_turn(make_tool_trainer, tool_tokenizer, mode):
    """A fixed two-turn episode (tool call, the tool's answer, a free second turn) for 8 completions: every generated
    token of both turns carries µ's top-K cells equal to the scripted model's temperature-scaled top-K at that position
    (and the sampled token's cell), recomputed by a plain forward; tool tokens carry none; µ equals the model's law at
    the sampled tokens. Tolerance 2e-5 as in test_integration_trl (decoding vs one full forward); cells one turn off or
    one position off differ by > 0.1."""
    trainer, rows = make_tool_trainer(mode)
    trainer.model.train()
    inputs = [dict(rows[i]) for i in range(0, 8, G) for _ in range(G)]
    if mode == "environments":
        inputs = [dict(rows[i // G]) for i in range(8)]  # a group of 4 per environment
    out = trainer._generate_and_score_completions(inputs)
    assert trainer._metrics["train"]["tools/call_frequency"][-1] == 1.0
    completion, tool_mask = out["completion_mask"].bool(), out["tool_mask"].bool()
    script = tool_tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tool_tokenizer.eos_token_id]
    answers, second_turn = set(), torch.zeros_like(completion)
    for row in range(8):
        n = int(completion[row].sum())
        shape = runs(tool_mask[row, :n].int().tolist())
        assert [v for v, _, _ in shape] == [1, 0, 1], shape  # turn 1, tool tokens, turn 2
        assert out["completion_ids"][row, :shape[0][2]].tolist() == script
        assert shape[2][2] - shape[2][1] <= FREE + 1
        answers.add(tool_tokenizer.decode(out["completion_ids"][row, shape[1][1]:shape[1][2]]))
        second_turn[row, shape[2][1]:shape[2][2]] = True
    assert len(answers) == (2 if mode == "environments" else 1)  # each environment's own tool answered

    generated, tools = completion & tool_mask, completion & ~tool_mask
    with torch.no_grad():
        ref = plain_scaled_logits(trainer.model, out, TAU).log_softmax(-1)
    ids, cells, valid = out["rollout_topk_ids"], out["rollout_topk_logp"], out["rollout_topk_valid"]
    assert ids.shape == (*completion.shape, K + 1)
    assert torch.equal(ids[..., :K][generated], ref.topk(K, -1).indices[generated])
    used = valid & generated[..., None]
    torch.testing.assert_close(cells[used], ref.gather(-1, ids)[used], rtol=0, atol=2e-5)
    assert valid[..., :K][generated].all() and not valid[tools].any()
    assert second_turn.sum() >= 8 and valid[..., K][second_turn].any()  # the sampled token outside µ's top-K occurs
    mu = out["sampling_per_token_logps"]
    sampled = ref.gather(-1, out["completion_ids"][..., None])[..., 0]
    torch.testing.assert_close(mu[generated], sampled[generated], rtol=0, atol=2e-5)


def test_topk_tv_trains_through_environment_factory(make_tool_trainer):
    """2 optimiser steps of DPPO-Top-K-TV on two-turn tool episodes through two environments: finite losses, every
    parameter moves, each step's episodes call the tool, and µ's cells equal π's at every generated token of both
    turns (Top-K TV < 1e-5: each step trains on its own fresh generation)."""
    trainer, _ = make_tool_trainer("environments", max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(logs) == 2
    for h in logs:
        assert math.isfinite(h["loss"]) and h["tools/call_frequency"] == 1.0
        assert h["dppo/mismatch/topk_tv_mean"] < 1e-5 and h["dppo/trust_region/masked_frac"] == 0
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) == len(before)


def test_topk_with_rollout_func_and_tools_refused(integ, make_tool_trainer):
    """A rollout_func gives the first turn's cells, TRL's own generation the later turns': refused, naming the field."""
    with pytest.raises(ValueError, match=r"^tools: with a rollout_func, TRL generates the turns after a tool call"):
        make_tool_trainer("tools", rollout_func=integ.dppo_rollout_func("hf"))

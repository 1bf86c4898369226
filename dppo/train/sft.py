"""A supervised warm start on an environment's synthetic transcripts, so that a small model learns the tool format
before RL (as verl's retool and prime-rl's wordle recipes do).

    losses = agent_sft(model, tokenizer, make_environment("calculator"), task.train, steps=60, batch_size=8, lr=3e-5)
    save_model(model, tokenizer, "runs/calc-sft")        # then: dppo train --preset calculator --model.name runs/calc-sft

Each training example becomes one episode laid out exactly as the episode runner (`dppo.episodes.env_loop`) lays
out what it samples, so SFT and RL train the same token sequences:

    prompt_ids    | ChatCodec.render(env.reset(example), tool schemas)      (tools in the system prompt when the
                  |                                                          template has no tools support)
    response_ids  | encode(assistant_1) <eos> | append(env messages)            | encode(assistant_2) <eos> ...
    loss_mask     | 1 ...               1     | 0 ...                         0 | 1 ...               1

The transcript is `env.demonstration(example)` (a correct episode after reset's messages). Loss: token-mean
cross-entropy over the loss-mask-1 tokens of the batch (`score_responses` over every real response token, the
environment's tokens included as context, then the mean over the mask-1 ones).

Cost: the tools prompt is the same long prefix of every example (~300 SmolLM2 tokens of a ~400-token episode).
The batch's longest common prompt prefix is scored once (`score_responses` shares a prompt across the responses
that have it), and the rest of each prompt goes in front of its response with loss mask 0: the same logits and the
same loss as scoring each whole prompt, about a third of the work on a CPU.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from dppo.envs.base import check_messages
from dppo.envs.tools import tool_schema
from dppo.episodes.chat import ChatCodec
from dppo.train.scoring import score_responses


@dataclass(frozen=True)
class Transcript:
    """One demonstration episode as token ids, in the episode runner's layout."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool]
    """True on assistant tokens (their stop token included), False on the environment's (boundary included)."""


def build_transcript(tokenizer, env, example, *, delta=None, name: str = "environment") -> Transcript:
    """`env.reset(example)` then `env.demonstration(example)` as ids laid out like a sampled episode.

    ValueError (naming the environment and the example) when the environment has no demonstration or the
    demonstration does not start with an assistant message."""
    delta = delta or ChatCodec(tokenizer)
    first = check_messages(env.reset(example), name)
    demo = env.demonstration(example) if callable(getattr(env, "demonstration", None)) else None
    if not demo:
        raise ValueError(f"environment {name!r}: no demonstration for example {example.uid} (its "
                         "demonstration(example) returned nothing); agent SFT needs one per training example")
    demo = [dict(m) for m in demo]
    if demo[0].get("role") != "assistant":
        raise ValueError(f"environment {name!r}: the demonstration of example {example.uid} starts with a "
                         f"{demo[0].get('role')!r} message; it must start with the assistant's first turn")
    schemas = [tool_schema(fn) for fn in getattr(env, "tools", ())]
    prompt = delta.render(first, schemas)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[bool] = []
    i = 0
    while i < len(demo):
        if demo[i]["role"] == "assistant":
            turn = list(tokenizer.encode(demo[i]["content"], add_special_tokens=False)) + [eos]
            ids += turn
            mask += [True] * len(turn)
            i += 1
            continue
        j = i
        while j < len(demo) and demo[j]["role"] != "assistant":
            j += 1
        if j == len(demo):  # environment messages after the last turn: the runner ends the episode before them
            break
        env_ids = delta.append(demo[i:j])  # (the boundary, then the messages)
        ids += env_ids
        mask += [False] * len(env_ids)
        i = j
    return Transcript(prompt, ids, mask)


def build_transcripts(tokenizer, env_factory: Callable, examples: Sequence, *, name: str = "environment") -> list[Transcript]:
    """`build_transcript` of every example, a fresh environment each (one `ChatCodec` for all)."""
    delta = ChatCodec(tokenizer)
    return [build_transcript(tokenizer, env_factory(), ex, delta=delta, name=name) for ex in examples]


def _common_prefix(seqs: Sequence[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for k in range(n):
        t = first[k]
        if any(s[k] != t for s in seqs):
            return k
    return n


def collate_transcripts(batch: Sequence[Transcript]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids per row, response ids [B, T], real-token mask [B, T], loss mask [B, T]).

    The rows' longest common prompt prefix (at least one token, when there is one) becomes every row's prompt, the
    rest of each prompt is put in front of its response with loss mask 0 (see the module docstring)."""
    k = _common_prefix([t.prompt_ids for t in batch])
    rows = []
    for t in batch:
        if k:
            prompt, head = t.prompt_ids[:k], t.prompt_ids[k:]
        else:  # nothing shared: each row keeps its own prompt
            prompt, head = t.prompt_ids, []
        rows.append((prompt, head + t.response_ids, [False] * len(head) + list(t.loss_mask)))
    T = max(len(r) for _, r, _ in rows)
    resp = torch.zeros((len(rows), T), dtype=torch.long)
    real = torch.zeros((len(rows), T), dtype=torch.bool)
    loss = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, (_, r, m) in enumerate(rows):
        resp[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        real[i, :len(r)] = True
        loss[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return [torch.tensor(p, dtype=torch.long) for p, _, _ in rows], resp, real, loss


def transcript_loss(model: nn.Module, batch: Sequence[Transcript], *, pad_id: int = 0) -> torch.Tensor:
    """Token-mean cross-entropy over the loss-mask-1 tokens of `batch` (with gradient)."""
    prompts, resp, real, loss_mask = collate_transcripts(batch)
    device = next(model.parameters()).device
    logp = score_responses(model, prompts, resp, real, pad_id=pad_id).logp
    loss_mask = loss_mask.to(device)
    return -(logp * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def agent_sft(
    model: nn.Module,
    tokenizer,
    env_factory: Callable,
    examples: Sequence,
    *,
    steps: int = 60,
    batch_size: int = 8,
    lr: float = 3e-5,
    seed: int = 0,
    log_every: int = 0,
    warmup_steps: int | None = None,
    grad_clip: float = 1.0,
) -> list[float]:
    """Train `model` in place on the environment's demonstrations of `examples`; returns the loss of each step.

    env_factory: a factory of fresh environments (`dppo.envs.make_environment(name, **options)`). Batches are drawn
    without replacement (a seeded permutation per epoch). AdamW, linear warm-up over `warmup_steps` (default: a
    tenth of the steps), then linear decay to a tenth of `lr`. The model is left in eval mode."""
    if not examples:
        raise ValueError("examples: expected a non-empty list")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")
    if not lr > 0:
        raise ValueError(f"lr: expected > 0, got {lr}")
    data = build_transcripts(tokenizer, env_factory, list(examples), name=type(env_factory()).__name__)
    rng = random.Random(seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    warm = max(1, steps // 10) if warmup_steps is None else max(1, warmup_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - max(0, s - warm) / max(1, steps - warm)))
    order: list[int] = []
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            batch = []
            for _ in range(batch_size):
                if not order:
                    order = list(range(len(data)))
                    rng.shuffle(order)
                batch.append(data[order.pop()])
            loss = transcript_loss(model, batch, pad_id=pad_id)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"[sft] step {step} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    finally:
        model.eval()
    return losses


def save_model(model: nn.Module, tokenizer, folder: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """`save_pretrained` of the model and the tokenizer into `folder`, atomically: written into a temporary sibling
    folder, then renamed into place, so a killed save never leaves a half-written model folder. An existing
    non-empty `folder` is an error unless `overwrite` (then it is replaced, after the new one is complete)."""
    folder = Path(folder)
    if folder.exists() and not (folder.is_dir() and not any(folder.iterdir())) and not overwrite:
        raise ValueError(f"--out: {folder} already exists (give another folder, or --overwrite to replace it)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    old = None
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if folder.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.rename(folder, old / folder.name)
        os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return folder


__all__ = ["Transcript", "agent_sft", "build_transcript", "build_transcripts", "collate_transcripts", "save_model",
           "transcript_loss"]

"""A short supervised warm start (teacher forcing on prompt → answer + EOS).

RL needs a policy that is sometimes right. The tests' learning check and the miniature stability study
start from a tiny random model that this module trains for a few hundred steps on a task's training
examples, so that its accuracy is low but nonzero. Loss: token-mean cross-entropy on the answer tokens only.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch
from torch import nn

from dppo.train.scoring import score_responses


def encode_prompt(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return list(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False))


def sft_warm_start(
    model: nn.Module,
    tokenizer,
    examples: Sequence,
    *,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
) -> list[float]:
    """Train `model` in place on (prompt, answer + EOS) pairs; returns the loss per step."""
    if not examples:
        raise ValueError("examples: expected a non-empty list")
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    pairs = [(torch.tensor(encode_prompt(tokenizer, ex.prompt)),
              tokenizer.encode(ex.answer, add_special_tokens=False) + [eos]) for ex in examples]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    model.train()
    losses = []
    for step in range(steps):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        T = max(len(a) for _, a in batch)
        resp = torch.zeros((len(batch), T), dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.bool)
        for i, (_, a) in enumerate(batch):
            resp[i, : len(a)] = torch.tensor(a)
            mask[i, : len(a)] = True
        logp = score_responses(model, [p for p, _ in batch], resp, mask, pad_id=tokenizer.pad_token_id or 0).logp
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if log_every and step % log_every == 0:
            print(f"[sft] step {step} loss {losses[-1]:.3f}", flush=True)
    model.eval()
    return losses

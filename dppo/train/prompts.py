"""Which training examples each step draws: a seeded permutation per epoch, whose position a checkpoint stores
(so a resumed run draws exactly the prompts an uninterrupted one would)."""

from __future__ import annotations

import torch


class PromptSampler:
    """Seeded epoch-wise permutation over the training examples; its position is part of a checkpoint."""

    def __init__(self, n: int, seed: int, position: int = 0) -> None:
        self.n, self.seed, self.position = n, seed, position

    def next(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            epoch, offset = divmod(self.position, self.n)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
            take = min(count - len(out), self.n - offset)
            out.extend(perm[offset:offset + take].tolist())
            self.position += take
        return out


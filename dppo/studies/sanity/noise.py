"""The mismatch knob `--logit-noise σ`: Gaussian noise on the logits the rollout engine samples from.

The engine samples every token from softmax(logits + σ·z), z ~ N(0, 1) drawn afresh for every vocabulary entry at
every sampled position, and records that perturbed distribution's log-probs as µ (it is the distribution actually
sampled from, so π/µ stays an exact importance weight). It is a controlled stand-in for a noisy inference engine;
the no-mismatch control is `--engine-dtype float32 --logit-noise 0`. The noise is off during the evaluation after
training (`NoisyRolloutTrainer`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dppo.train.config import Config
from dppo.train.trainer import Trainer


class LogitNoise:
    """A controlled training–inference mismatch: Gaussian noise on the logits an engine samples from.

    Registers a forward hook on `engine_model`'s output embedding (the lm-head) that returns
    logits + σ·z in float32, z ~ N(0, 1) drawn from its own generator (seeded by `seed`) afresh for every row,
    position and vocabulary entry. An engine that samples from softmax(logits / τ) and records the log-probs of
    that distribution (the `hf` engine does) then samples from the perturbed policy µ_σ and records log µ_σ
    honestly. With σ = 0 or `enabled = False` the logits pass unchanged. (The `hf` engine runs a prompt's prefill
    once and shares its logits by the prompt's n responses, so at the first response position the noise is drawn
    once per distinct prompt; later positions get independent noise per response.)

    `record = True` keeps, for every hook call, the exact E_{a~µ_σ}|π(a) − µ_σ(a)| per row of the last position
    (π = the unperturbed distribution at temperature `temperature`) in `expected_tv` (list of [B] tensors): the
    mismatch the knob produces, which a Monte Carlo estimate over sampled tokens must match.
    """

    def __init__(self, engine_model: torch.nn.Module, sigma: float, *, seed: int = 0, temperature: float = 1.0,
                 record: bool = False) -> None:
        if not sigma >= 0 or not math.isfinite(sigma):
            raise ValueError(f"logit_noise: expected a finite value >= 0, got {sigma!r}")
        self.sigma, self.temperature, self.record = float(sigma), float(temperature), record
        self.enabled = True
        self.expected_tv: list[Tensor] = []
        self._gen = torch.Generator().manual_seed(int(seed))
        self._handle = engine_model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, inputs, output: Tensor) -> Tensor | None:
        if not self.enabled or self.sigma == 0.0:
            return None
        clean = output.float()
        noise = torch.randn(clean.shape, generator=self._gen, dtype=torch.float32).to(clean.device)
        noisy = clean + self.sigma * noise
        if self.record:
            p = (clean[:, -1] / self.temperature).softmax(-1)
            m = (noisy[:, -1] / self.temperature).softmax(-1)
            self.expected_tv.append((m * (p - m).abs()).sum(-1).cpu())
        return noisy

    def remove(self) -> None:
        self._handle.remove()


def _engine_model(trainer: Trainer) -> torch.nn.Module:
    """The transformers model the trainer's rollout engine samples with (the `hf` engine's copy of the policy):
    the one place this study reaches into the trainer's engine."""
    return trainer.engine.model


class NoisyRolloutTrainer(Trainer):
    """A `Trainer` whose engine samples through `LogitNoise(σ)` during training; evaluation samples without it."""

    def __init__(self, cfg: Config, run_dir, *, logit_noise: float, noise_seed: int) -> None:
        super().__init__(cfg, run_dir)
        self.noise = LogitNoise(_engine_model(self), logit_noise, seed=noise_seed, temperature=cfg.rollout.temperature)

    def evaluate(self, *args, **kwargs):
        self.noise.enabled = False
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.noise.enabled = True

"""dppo: Divergence Proximal Policy Optimization for RL fine-tuning of language models.

The library half (divergences, trust-region masks, losses, advantages, log-prob kernels) is pure
tensor code; the trainer, engines and logger hold all state. See README.md and docs/library.md.
"""

__version__ = "0.1.0"

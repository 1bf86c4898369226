"""DPPO inside Hugging Face TRL (1.16): `DPPOConfig` / `DPPOTrainer`, drop-ins for `GRPOConfig` / `GRPOTrainer`,
and `dppo_rollout_func`, a TRL `rollout_func` on dppo's engines that records µ's top-K (Top-K TV/KL).

A GRPO script becomes DPPO by changing the config and trainer classes (docs/integrations.md shows the diff). The
loss is `dppo.losses.policy_loss` (Eq. 23: −keep·sg(min(π/µ, C))·Â·log π) on TRL's per-token tensors, so every
trust region of `dppo.trust_region.TRUST_REGIONS` runs inside TRL with the defaults and checks of dppo's own config.

Where µ (the rollout policy, the anchor of the trust region and the denominator of the importance weight) comes
from; never from a recomputed forward (TRL's `old_per_token_logps` only moves the *mask* with anchor="recompute"):
- transformers generation (TRL's default path, replaced here): the log-softmax of the final scores each token was
  drawn from, i.e. after temperature, top-k/top-p/min-p and the other logits processors, recorded during `generate`
  by a logits processor placed last (one [B, V] tensor alive at a time, never all steps' scores);
- vLLM colocate: TRL's engine runs with ``logprobs_mode="processed_logprobs"`` (the sampled distribution);
- vLLM server: the same, checked at construction (a server in "raw_logprobs" mode is refused);
- a `rollout_func`: its "logprobs". For the Top-K regions they are per token the K+1 cells (docs/library.md, "Decisions
  where the paper left room": µ's top-K sorted by µ, then the sampled token when it is not among them, NaN in that slot
  otherwise), with the token ids in "logprob_token_ids" (same shape, TRL 1.16's rollout_func contract).
  `dppo_rollout_func` returns exactly that. The transformers path above records the same cells when the trust region
  needs them.

µ's alignment is an invariant checked before the loss: one row per completion, one value (or one row of K+1 cells) per
completion token, for the completion's own ids. Decoding that does not sample each token from the recorded µ (beam
search, greedy, assisted/speculative decoding, warpers applied after the recorder: `config.NOT_SAMPLED`) is refused by
name when the config and the trainer are built; a `generate` that never ran the recorder raises `MuNotRecordedError`.

GRPOTrainer's terms orthogonal to the trust region compose with every region as in GRPOTrainer (`terms`): the entropy
bonus (fixed or adaptive), the entropy filter (`top_entropy_quantile`) and the off-policy sequence mask
(`off_policy_mask_threshold`, on `dppo.sequence_mask`). TRL's tool loop (`tools=`, `environment_factory=`) records µ's
top-K cells for every generated token of every turn, so the Top-K regions train on tool-calling episodes.

Aggregation: TRL's `loss_type` selects one of dppo's aggregation modes (`LOSS_TYPE_AGGREGATION`), with TRL's own
normalisers, so a recipe's learning rate keeps its meaning. TRL's default "dapo" is token-mean over the active tokens
of the whole generation batch (dppo's default, the paper's seq-mean-token-sum-norm, is `loss_type="dr_grpo"`). Ratio
clip ε of the PPO regions are TRL's `epsilon` / `epsilon_high` (None: the registry's 0.28, clip-higher).

Metrics (per micro-batch, one all-reduce; listed in docs/integrations.md): TRL's names where TRL has the quantity
(`clip_ratio/{low,high,region}_mean` = masked tokens by advantage sign, `sampling/sampling_logp_difference/*`,
`entropy`), otherwise `dppo train`'s names (`dppo.metrics.NAMES`) behind the prefix "dppo/"
(`dppo/trust_region/masked_frac*`, `dppo/ratio/*`, `dppo/mismatch/*`), and `dppo/unscored_frac`.

Layout: `config` (DPPOConfig, its checks, LOSS_TYPE_AGGREGATION, check_sampling), `recorder` (µ recorded during
transformers generation, the K+1 cells, kept per generated turn), `terms` (off-policy mask, entropy bonus), `trainer`
(DPPOTrainer), `rollout_func` (dppo_rollout_func); this module re-exports their public names. TRL is imported in
this package only: `import dppo` never needs it.
"""

from __future__ import annotations

import warnings

try:
    import trl
    from accelerate.utils import is_peft_model  # noqa: F401 - the adapter's other dependencies, checked here once
    from transformers import LogitsProcessor  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dppo.integrations.trl needs TRL 1.16: pip install --no-deps trl==1.16.0") from exc

TRL_VERSION = "1.16"
if not trl.__version__.startswith(TRL_VERSION + "."):
    warnings.warn(f"dppo.integrations.trl is written against TRL {TRL_VERSION}.x (it overrides GRPOTrainer's "
                  f"generation and loss methods); found {trl.__version__}", stacklevel=2)

from dppo.integrations.trl.config import (LOSS_TYPE_AGGREGATION, NOT_SAMPLED, DPPOConfig,  # noqa: E402
                                          check_sampling, check_server_logprobs)
from dppo.integrations.trl.recorder import MuNotRecordedError  # noqa: E402
from dppo.integrations.trl.rollout_func import DPPORolloutFunc, dppo_rollout_func  # noqa: E402
from dppo.integrations.trl.trainer import DPPOTrainer  # noqa: E402

__all__ = ["DPPOConfig", "DPPOTrainer", "DPPORolloutFunc", "LOSS_TYPE_AGGREGATION", "MuNotRecordedError",
           "NOT_SAMPLED", "check_sampling", "check_server_logprobs", "dppo_rollout_func"]

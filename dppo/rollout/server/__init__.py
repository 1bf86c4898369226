"""vLLM's own server as a rollout engine (`vllm-server`): processes dppo starts or servers it attaches to
(`launch`), HTTP to them (`client`), the engine (`engine`), and what runs inside vLLM's processes: the launcher
(`serve`), dppo's vLLM plugin (`plugin`) and its CPU weight-transfer engine (`transfer`). Nothing here imports vLLM
in the trainer's process."""

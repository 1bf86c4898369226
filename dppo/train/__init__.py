"""The training system: config and presets, building the parts, the rollout batch, the trainer and its forward
(scoring), the weights it publishes, evaluation, torchrun collectives, plots, and the supervised warm start of an
agent (`sft`: `dppo sft`). The files a run writes (run directory, checkpoints, logs, export) are `dppo.run_files`,
one layer below."""

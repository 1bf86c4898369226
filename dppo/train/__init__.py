"""The training system: config and presets, building the parts, the rollout batch, the trainer and its forward
(scoring), evaluation, checkpoints, torchrun collectives, logging, hardware-aware precision, model loading."""

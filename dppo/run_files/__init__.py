"""The files a run writes, below the config: the run directory's one writer (`run_dir`: disk errors as one
`RunDirError`, the checkpoint folders' layout), crash-safe checkpoints (`checkpoint`), the JSONL logs and
experiment trackers (`logger`), and a model as a Hugging Face folder (`export`).

Nothing here imports `dppo.train`: the config imports from this package (the tracker names), never the reverse;
what a module here needs of the run is passed in as arguments.
"""

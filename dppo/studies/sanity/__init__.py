"""`dppo sanity`: the paper's stability study (Fig. 3, §5) and its ablations (§6, §7.3, F.4) scaled to a CPU.

Every method trains the same warm-started tiny character-level model on a built-in task (addition, or reverse for
long responses) with the same lr, batch and steps, over seeds, while the rollout engine differs from the trainer
(a bf16 engine, fp8 weights, a stale engine or logit noise); only the loss differs. The study prints a table and
writes `sanity.json` and `sanity.png`; `dppo sanity report` merges studies run as several processes and prints a
mismatch study beside its control, with the mismatch averaged per quarter of the run.

The package, one module per job:
- `config`: `SanityConfig`, the study's one config; its fields are the flags, its docstrings the help;
- `methods`: the method names, groups and loss overrides (`--methods`), and the mismatch sources (`--mismatch`);
- `noise`: the logit-noise mismatch knob (`LogitNoise`) and the trainer that samples through it;
- `summary`: per-run and per-method summaries, collapse detection, the table and the curves;
- `run`: the warm start, each run's trainer config, `run_sanity` and the `dppo sanity` command;
- `report`: `dppo sanity report`;
- `warning`: `dppo sanity warning`, the collapse warning's held-out study (`dppo.collapse_warning`).
"""

from dppo.studies.sanity.config import (QUICK, SANITY_TASKS, TASK_DEFAULTS, SanityConfig, default_max_new_tokens,
                                        parse_args, task_options)
from dppo.studies.sanity.methods import (METHOD_GROUPS, MISMATCH_SOURCES, SANITY_METHODS, expand_methods, method_loss,
                                         parse_mismatch)
from dppo.studies.sanity.noise import LogitNoise, NoisyRolloutTrainer
from dppo.studies.sanity.run import cmd_sanity, run_sanity, sanity_config, study_settings, warm_start
from dppo.studies.sanity.summary import (CURVE_KEYS, format_table, is_collapsed, plot_sanity, running_mean,
                                         steps_to_accuracy, summarize_method, summarize_run)

__all__ = ["CURVE_KEYS", "METHOD_GROUPS", "MISMATCH_SOURCES", "QUICK", "SANITY_METHODS", "SANITY_TASKS",
           "TASK_DEFAULTS", "LogitNoise", "NoisyRolloutTrainer", "SanityConfig", "cmd_sanity", "default_max_new_tokens",
           "expand_methods", "format_table", "is_collapsed", "method_loss", "parse_args", "parse_mismatch",
           "plot_sanity", "run_sanity", "running_mean", "sanity_config", "steps_to_accuracy", "study_settings",
           "summarize_method", "summarize_run", "task_options", "warm_start"]

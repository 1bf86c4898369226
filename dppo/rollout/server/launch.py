"""Starting and stopping the vLLM servers dppo owns (`ServerProcess`), and reading why one failed.

A server is ``python -m dppo.rollout.server.serve --parent <this pid> --model FOLDER ...`` (`dppo.rollout.server.serve`)
in a session of its own, its output in a log file. The flags dppo always passes, and why:
- ``--tokens-only``: the token-in-token-out endpoint ``/inference/v1/generate`` (prompt ids in, token ids, µ and µ's
  top-K out, and the weight-version span of every token); nothing is tokenised or detokenised on the server
  (``--skip-tokenizer-init``): the trainer's tokenizer is the only one.
- ``--logprobs-mode processed_logprobs``: log-probs of the distribution actually sampled (after temperature).
- ``--max-logprobs K+1``: the endpoint lists the sampled token first and cuts the list at K entries, so dppo asks
  for K+1 and keeps ranks 1..K (`dppo.rollout.server.client.parse_choice`).
- ``--weight-transfer-config {"backend": "dppo_shm"}`` and ``VLLM_SERVER_DEV_MODE=1``: the RL API (`/pause`,
  `/update_weights`, ...) through which weights arrive, as a file in shared memory (on CUDA too: vLLM's NCCL
  engine is not wired in yet, docs/engines.md).
- ``HF_HUB_OFFLINE=1``: the model is a local folder; nothing is looked up on the Hub.
- ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (CPU, unless set): vLLM keeps one core off its OpenMP threads otherwise.

Failures before training name the server, its log and the cause read from the log: a port in use is found before
the start; a missing model folder is refused before the start; a process that exits while starting (out of memory
included: exit by SIGKILL) or that is not healthy within `start_timeout_s` is an error with the log's last lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dppo.rollout.server.plugin import BACKEND

LOG_TAIL_LINES = 15
SERVER_ENTRY_ENV = "DPPO_SERVER_ENTRY"
"""Test seam (like DPPO_FAULT_INJECT): a script run instead of ``-m dppo.rollout.server.serve``, with the same
arguments (tests/rollout/fake_vllm_server.py: a fake vLLM server for the tests of dppo's own server logic)."""
_CAUSES = (
    (("Address already in use", "Errno 98"), "the port is in use"),
    (("out of memory", "OutOfMemory", "Cannot allocate memory", "MemoryError", "std::bad_alloc"), "out of memory"),
    (("No available memory for the cache blocks", "KV cache", "max_model_len"), "not enough memory for the KV cache"),
    (("config.json", "No such file or directory", "is not a valid", "Invalid repository"), "the model could not be "
                                                                                          "loaded"),
)


_ERROR_LINE = re.compile(r"Error|Errno|bad_alloc")
"""A log line that reports an error (where `failure_cause` looks)."""


class ServerError(RuntimeError):
    """A server failed (to start, to answer, or to take weights); the message names it, its log and the cause."""


class ServerDown(ServerError):
    """The server itself failed (it is gone, hangs or reports a fault), as opposed to refusing one request."""


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int | None = LOG_TAIL_LINES) -> str:
    """The log's last `lines` lines (None: its last MiB, whole lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 2**20))
            text = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:] if lines else text)


def failure_cause(log: str, returncode: int | None) -> str:
    """The likeliest cause of a failed start, read from the error lines of the server's log (and its exit code):
    only lines that carry an error (an exception's name, an errno, bad_alloc), since a healthy start's INFO lines
    mention the KV cache and max_model_len too."""
    if returncode is not None and returncode == -signal.SIGKILL:
        return "killed by SIGKILL (out of memory?)"
    errors = [line.strip() for line in log.splitlines() if _ERROR_LINE.search(line)]
    for needles, cause in _CAUSES:
        if any(n in line for line in errors for n in needles):
            return cause
    named = [line for line in errors if "Error" in line]
    return named[-1] if named else f"exit code {returncode}"


@dataclass
class ServerLaunch:
    """How dppo starts one server process (everything but the port and the log), from its engine's settings
    (`dppo.rollout.server.engine.ServerEngine`)."""

    model: str
    """The model folder (config.json + safetensors)."""
    dtype: str = "float32"
    max_logprobs: int = 21
    kv_cache_gb: float = 1.0
    seed: int = 0
    device: str = "cpu"
    max_model_len: int | None = None
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags (rollout.vllm_server.args, and the LoRA flags)."""

    def command(self, port: int) -> list[str]:
        """The server's command line. Test seam: with `SERVER_ENTRY_ENV` (DPPO_SERVER_ENTRY) set, that script runs
        instead of ``-m dppo.rollout.server.serve``, same arguments (restarts included)."""
        entry = os.environ.get(SERVER_ENTRY_ENV)
        cmd = [sys.executable, *([entry] if entry else ["-m", "dppo.rollout.server.serve"]),
               "--parent", str(os.getpid()), "--model", self.model, "--host", self.host, "--port", str(port),
               "--dtype", self.dtype, "--seed", str(self.seed), "--max-logprobs", str(self.max_logprobs),
               "--logprobs-mode", "processed_logprobs", "--tokens-only", "--skip-tokenizer-init",
               "--disable-log-stats", "--uvicorn-log-level", "warning"]
        if self.device == "cpu":
            cmd += ["--kv-cache-memory-bytes", str(int(self.kv_cache_gb * 2**30))]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        cmd += ["--weight-transfer-config", '{"backend": "%s"}' % BACKEND]
        if self.device == "cpu":
            cmd += ["--enforce-eager"]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the in-process engine's setting, not a server's
        if "--enable-lora" in self.extra_args:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter (adapter-only sync)
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            # vLLM-CPU keeps one core per server off its OpenMP threads for its scheduler process; on a small machine
            # that is half the cores (measured on 2 cores: docs/benchmarks.md, bench_server). The scheduler shares.
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        elif ":" in self.device:
            env["CUDA_VISIBLE_DEVICES"] = self.device.split(":")[1]
        return env


class ServerProcess:
    """One vLLM server dppo started (see the module docstring). `name` is how errors call it."""

    def __init__(self, settings: ServerLaunch, *, name: str, log_dir: Path, port: int = 0) -> None:
        if not (Path(settings.model) / "config.json").is_file():
            raise ServerError(f"{name}: model {settings.model!r} has no config.json (not a model folder)")
        if port and port_in_use(settings.host, port):
            raise ServerError(f"{name}: port {port} on {settings.host} is in use")
        self.name, self.settings = name, settings
        self.port = port or free_port(settings.host)
        self.url = f"http://{settings.host}:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"{name}-port{self.port}.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(settings.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=settings.environment(),
                                         start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit code once the server process has ended, else None."""
        return self.proc.poll()

    def describe_exit(self) -> str:
        code = self.proc.poll()
        log = log_tail(self.log, None)
        tail = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
        # the cause from the whole log: the root cause can be far above the tail (the engine core's own traceback,
        # then the API server's, then more lines under load)
        cause = failure_cause(log, code)
        return (f"{self.name} ({self.url}, pid {self.pid}) exited with code {code}: {cause}; "
                f"log {self.log}:\n{tail}")

    def wait_healthy(self, timeout_s: float, healthy) -> None:
        """Block until `healthy()` is True; ServerError naming the cause when the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited() is not None:
                raise ServerError(f"failed to start: {self.describe_exit()}")
            if healthy():
                return
            time.sleep(0.5)
        tail = log_tail(self.log)
        self.stop()
        raise ServerError(f"{self.name} ({self.url}) was not healthy after {timeout_s:g} s; log {self.log}:\n{tail}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `grace_s`; when the API process has
        already exited, SIGKILL at once to what is left of its group (its engine core and worker)."""
        if self.proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
                break
        with contextlib.suppress(ProcessLookupError):  # vLLM's engine core and workers, whatever the API server did
            os.killpg(self.proc.pid, signal.SIGKILL)

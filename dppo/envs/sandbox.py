"""A sandbox for model-written Python code: the isolation behind a `python` tool in multi-turn RL (docs/sandbox.md).

`run_python(code)` runs `code` with a stdlib-only system interpreter (`python3 -I -S`) in a fresh temp dir under the
strongest isolating layer this machine has: "bwrap" (bubblewrap: new user, pid, net, ipc, uts and mount namespaces
over a read-only /usr), else "unshare" (net, pid and mount namespaces; directories outside /usr, /etc, /dev covered by
empty tmpfs). It fails closed: when neither can start, the default is an error naming each layer's reason and the
fix, never a silent fall-back; "rlimits" (limits only: network and filesystem open) runs only when chosen by name.
All set CPU, memory, process and file-size rlimits as an unprivileged user (root drops to uid 65534: RLIMIT_NPROC
does not bind uid 0); the wall-time limit kills the whole process group. The temp dirs live under a root that user
can traverse whatever TMPDIR is (`work_root`). Whatever the code does, the caller gets a `SandboxResult`, never an
exception.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NOBODY = 65534
"""The uid (and gid) a root caller drops to before the sandbox starts."""
_HELPERS = 3
"""RLIMIT_NPROC counts the sandbox's own processes (bwrap, its pid 1, the wrapper) too: room for them is added."""
_ALLOWED_TOP = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev"}
"""Top-level directories the "unshare" layer leaves visible (read-only to the unprivileged sandbox user)."""
_SIGNALS = {s.value: s.name for s in signal.Signals}
_ETC = ("ld.so.cache", "localtime")
"""The only /etc files bwrap exposes (the dynamic loader's cache, the time zone)."""


@dataclass(frozen=True)
class Limits:
    """What one `run_python` call may use; `processes` counts threads too (RLIMIT_NPROC)."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 65536

    def __post_init__(self):
        for name, kind in (("wall_s", (int, float)), ("cpu_s", (int, float)), ("memory_mb", int),
                           ("processes", int), ("output_bytes", int)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
                raise ValueError(f"Limits.{name} must be a positive {getattr(kind, '__name__', 'number')}, "
                                 f"got {value!r}")
        if self.memory_mb < 32:
            raise ValueError(f"Limits.memory_mb must be at least 32 (the interpreter needs it), got {self.memory_mb}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed program did. `reason` is None on a normal exit (any exit code), else one of "wall_time",
    "cpu_time", "memory", "killed", "signal:<NAME>", "error:<what>"."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    reason: str | None
    layer: str


@dataclass(frozen=True)
class Layer:
    """`check()`: None when usable, else why not; `argv(work, python)`: the command prefix that runs the wrapper;
    `hides`: the wrapper covers the filesystem itself (the "unshare" layer)."""

    check: Callable[[], str | None]
    argv: Callable[[str, str], list[str]]
    isolates: str
    hides: bool = False


def _python() -> str:
    """A system interpreter (stdlib only, outside any home); the running one's as the last resort."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _bwrap_argv(work: str, python: str) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/", top)
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    for name in _ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    if not python.startswith("/usr/"):
        argv += ["--ro-bind", sys.base_prefix, sys.base_prefix]
    return argv + ["--proc", "/proc", "--dev", "/dev", "--size", str(64 << 20), "--tmpfs", "/tmp",
                   "--bind", work, work, "--chdir", work]


def _unshare_argv(work: str, python: str) -> list[str]:
    return [shutil.which("unshare") or "unshare", "--net", "--map-root-user", "--mount", "--pid", "--fork",
            "--mount-proc", "--kill-child"]


def _probe(name: str) -> str | None:
    """None when layer `name` runs a trivial program end to end here, else the reason it does not."""
    if not shutil.which(name):
        return f"{name} is not installed"
    res = _execute(name, "print('ok')", Limits(wall_s=20.0), "")
    if res.exit_code != 0 or res.stdout != "ok\n":
        return f"{name} cannot isolate here: {res.reason or ''} {res.stderr.strip()[-200:]}".strip()
    return None


def _drop() -> dict:  # Popen arguments that drop a root caller to uid/gid 65534
    return dict(user=NOBODY, group=NOBODY, extra_groups=[]) if os.geteuid() == 0 else {}


LAYERS: dict[str, Layer] = {
    "bwrap": Layer(lambda: _probe("bwrap"), _bwrap_argv,
                   "network, filesystem (only /usr and a few /etc files, read-only), processes, IPC, hostname"),
    "unshare": Layer(lambda: _probe("unshare"), _unshare_argv,
                     "network, processes; filesystem only partly: /usr, /etc and /dev stay readable, other "
                     "top-level directories (/root, /home, /tmp, /work, ...) and the project/run dirs are hidden",
                     hides=True),
    "rlimits": Layer(lambda: None, lambda work, python: [],
                     "nothing: NETWORK AND FILESYSTEM ARE OPEN (only CPU, memory, process and wall-time limits)"),
}
"""Isolation layers by name, strongest first."""


@functools.lru_cache(maxsize=None)
def _why_unavailable(name: str) -> str | None:
    return LAYERS[name].check()


ISOLATING = ("bwrap", "unshare")
"""The layers that isolate network and filesystem: the default picks one of them or refuses (fails closed)."""


def available_layers() -> list[str]:
    """The usable layers, strongest first ("rlimits" always is)."""
    return [name for name in LAYERS if _why_unavailable(name) is None]


def detect_layer() -> str:
    """The strongest usable isolating layer; ValueError naming each one's reason and the fix when none works (the
    sandbox never degrades to "rlimits" unless that layer is chosen by name)."""
    for name in ISOLATING:
        if _why_unavailable(name) is None:
            return name
    why = "; ".join(f"{name}: {_why_unavailable(name)}" for name in ISOLATING)
    raise ValueError(f"no isolating sandbox layer can start here ({why}). Fix: install bubblewrap (apt install "
                     f"bubblewrap) or allow unprivileged user namespaces; to run with CPU/memory/time limits only "
                     f"(NETWORK AND FILESYSTEM OPEN) choose the layer 'rlimits' explicitly")


def _resolve(layer: str | None) -> str:
    if layer is None or layer == "auto":
        return detect_layer()
    if layer not in LAYERS:
        raise ValueError(f"unknown sandbox layer {layer!r}; valid: {', '.join(LAYERS)}")
    why = _why_unavailable(layer)
    if why is not None:
        raise ValueError(f"sandbox layer {layer!r} is not available: {why}")
    return layer


def describe_layer(layer: str | None = None) -> str:
    """The one-line start-up message: the layer in use, what it isolates and, for the weak ones, what not
    (ValueError, as `run_python`, when the layer cannot start: the run stops before training)."""
    name = _resolve(layer)
    line = f"sandbox: {name} isolates {LAYERS[name].isolates}"
    if name != "bwrap":
        why = _why_unavailable("bwrap")
        line += f" -- WEAKER THAN bwrap ({why or 'not selected'}; install bubblewrap for full isolation)"
    return line


_WRAPPER = r"""
import ctypes, json, os, resource, sys
cfg, libc = json.loads(sys.argv[1]), ctypes.CDLL(None, use_errno=True)
status = cfg["status_fd"]
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program cannot reach the status pipe through /proc
if cfg["hide"]:
    def mount(src, dst, fs, flags, data):
        if libc.mount(src.encode(), dst.encode(), fs and fs.encode(), flags, data and data.encode()):
            raise OSError(ctypes.get_errno(), "mount " + dst)
    keep = [(os.open(p, os.O_RDONLY | os.O_DIRECTORY), p) for p in cfg["keep"]]
    for path in cfg["hide"]:
        mount("tmpfs", path, "tmpfs", 2 | 4, "size=1m,mode=0755")  # MS_NOSUID | MS_NODEV
    for fd, path in keep:
        os.makedirs(path, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, path, None, 4096, None)  # MS_BIND
        os.close(fd)
    os.chdir(cfg["work"])
    for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):  # no capability survives exec
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
pid = os.fork()
if pid == 0:
    try:
        os.close(status)
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.execv(cfg["python"], [cfg["python"], "-I", "-S", "main.py"])
    finally:
        os._exit(127)
_, code, usage = os.wait4(pid, 0)
os.write(status, json.dumps({"status": code, "cpu": usage.ru_utime + usage.ru_stime}).encode())
"""


def _count_procs(uid: int) -> int:
    """How many processes `uid` runs now (RLIMIT_NPROC of the "rlimits" layer counts them all)."""
    n = 0
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            n += entry.name.isdigit() and entry.stat().st_uid == uid
    return n


def _hidden(work: str, python: str) -> tuple[list[str], list[str]]:
    """For the "unshare" layer: the directories to cover with an empty tmpfs, and those to bind back."""
    keep = [work] + ([] if python.startswith("/usr/") else [sys.base_prefix])
    hide = [str(p) for p in Path("/").iterdir() if p.is_dir() and not p.is_symlink() and p.name not in _ALLOWED_TOP]
    for extra in (os.getcwd(), os.path.expanduser("~"), str(Path(__file__).resolve().parents[2]), "/dev/shm"):
        if os.path.isdir(extra) and extra != "/" and not any(extra.startswith(h + "/") for h in hide):
            hide.append(extra)
    return sorted(hide, key=len), keep


def _text(data: bytearray, dropped: int, cap: int) -> str:
    more = f"\n[... output truncated: {dropped} more bytes past the {cap}-byte cap ...]" if dropped else ""
    return data.decode("utf-8", errors="replace") + more


def run_python(code: str, *, limits: Limits = Limits(), layer: str | None = None, stdin: str = "") -> SandboxResult:
    """Run `code` in a fresh temp dir under `layer` (None or "auto": the strongest isolating one) within `limits`;
    never raises for anything the code does (an unknown or unusable `layer`, or no isolating layer for the default,
    is a ValueError)."""
    return _execute(_resolve(layer), code, limits, stdin)


def _traversable(path: Path, uid: int) -> bool:
    """True when `uid` can enter `path` and every directory above it (as root: the 'other' execute bit, since the
    sandbox runs as uid 65534; else the caller's own access)."""
    if uid != NOBODY:
        return os.access(path, os.W_OK | os.X_OK)
    for p in (path, *path.parents):
        try:
            mode = p.stat().st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return os.access(path, os.W_OK | os.X_OK)


def work_root() -> str:
    """Where the sandbox's temp dirs go: the first of TMPDIR (tempfile's choice), /tmp, /var/tmp, /dev/shm that the
    sandbox user can reach (a 0700 TMPDIR, as `mktemp -d` makes, is one it cannot). OSError naming the candidates
    when none can be used."""
    uid = NOBODY if os.geteuid() == 0 else os.getuid()
    candidates = dict.fromkeys([tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"])
    for cand in candidates:
        path = Path(cand)
        if path.is_dir() and _traversable(path.resolve(), uid):
            return str(path)
    raise OSError(f"no temp directory the sandbox user (uid {uid}) can enter: tried {', '.join(candidates)}; "
                  f"point TMPDIR at a directory every user can traverse (mode 0711 or 1777 on it and its parents)")


def _execute(name: str, code: str, limits: Limits, stdin: str) -> SandboxResult:
    work = None
    try:
        work = tempfile.mkdtemp(prefix="dppo-sandbox-", dir=work_root())
        Path(work, "main.py").write_text(code, encoding="utf-8", errors="surrogateescape")
        if os.geteuid() == 0:
            for path in (work, os.path.join(work, "main.py")):
                os.chown(path, NOBODY, NOBODY)
        return _run(name, LAYERS[name], _python(), work, limits, stdin)
    except Exception as err:  # the sandbox itself failed (no disk space, fork failed, ...): still a result
        return SandboxResult("", "", None, False, f"error:{type(err).__name__}: {err}", name)
    finally:
        if work:
            shutil.rmtree(work, ignore_errors=True)


def _run(name: str, spec: Layer, python: str, work: str, limits: Limits, stdin: str) -> SandboxResult:
    cpu, mem = max(1, int(limits.cpu_s + 0.999)), limits.memory_mb << 20
    uid = NOBODY if os.geteuid() == 0 else os.getuid()
    nproc = limits.processes + _HELPERS + (_count_procs(uid) if name == "rlimits" else 0)
    rlimits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", mem, mem), ("RLIMIT_NPROC", nproc, nproc),
               ("RLIMIT_FSIZE", mem, mem), ("RLIMIT_CORE", 0, 0), ("RLIMIT_NOFILE", 256, 256)]
    hide, keep = _hidden(work, python) if spec.hides else ([], [])
    status_r, status_w = os.pipe()
    cfg = dict(status_fd=status_w, hide=hide, keep=keep, work=work, python=python, rlimits=rlimits)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"}
    argv = spec.argv(work, python) + [python, "-I", "-S", "-c", _WRAPPER, json.dumps(cfg)]
    with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: a program that never reads cannot block us
        stdin_file.write(stdin.encode("utf-8"))
        stdin_file.seek(0)
        try:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=stdin_file, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True, **_drop())
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
    out, err, dropped = bytearray(), bytearray(), {1: 0, 2: 0}
    timed_out, status = False, bytearray()
    deadline, ended = time.monotonic() + limits.wall_s, None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, (out, 1))
            sel.register(proc.stderr, selectors.EVENT_READ, (err, 2))
            sel.register(status_r, selectors.EVENT_READ, (status, 0))
            while sel.get_map():
                now = time.monotonic()
                if ended is not None and now > ended + 0.5:
                    break  # the program ended; a background process it left holds the pipes open
                if now >= deadline:
                    timed_out = True
                    break
                for key, _ in sel.select(timeout=min(deadline - now, 0.25)):
                    chunk = os.read(key.fd, 65536)
                    buf, which = key.data
                    if not chunk:
                        sel.unregister(key.fileobj)
                        ended = ended if which else time.monotonic()
                    elif which and len(buf) + len(chunk) > limits.output_bytes:
                        room = max(0, limits.output_bytes - len(buf))
                        buf += chunk[:room]
                        dropped[which] += len(chunk) - room
                    else:
                        buf += chunk
    finally:  # always, and before the leader is reaped (its pid, the group's id, cannot be reused until then)
        _kill(proc)
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(status_r)
    stdout, stderr = _text(out, dropped[1], limits.output_bytes), _text(err, dropped[2], limits.output_bytes)
    if timed_out:
        return SandboxResult(stdout, stderr, None, True, "wall_time", name)
    try:
        report = json.loads(bytes(status))
    except ValueError:
        why = stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return SandboxResult(stdout, stderr, None, False, f"error:sandbox failed: {why[0][:200]}", name)
    raw = report["status"]
    if os.WIFSIGNALED(raw):
        sig = os.WTERMSIG(raw)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and report["cpu"] >= cpu - 0.05):
            reason = "cpu_time"
        else:
            reason = "killed" if sig == signal.SIGKILL else f"signal:{_SIGNALS.get(sig, sig)}"
        return SandboxResult(stdout, stderr, None, False, reason, name)
    exit_code = os.WEXITSTATUS(raw)
    last = stderr.rstrip().rsplit("\n", 1)[-1]
    reason = "memory" if exit_code != 0 and last.startswith("MemoryError") else None
    return SandboxResult(stdout, stderr, exit_code, False, reason, name)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's whole process group (a pid namespace dies with its pid 1 as well)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()

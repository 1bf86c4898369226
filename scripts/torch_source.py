"""Which torch build scripts/ensure-venv.sh installs, and from where: the pip arguments for torch==<lock's version>.

The decision (`decide`) is a pure function of the machine's facts, so the suite tests every branch with fake ones
(tests/test_torch_source.py); `python scripts/torch_source.py` probes the real machine and prints, on stdout, the
build (`cpu` or `cuda`) on the first line and then one pip argument a line (none when torch is not to be installed),
and on stderr why. Standard library only: it runs with a fresh venv's python, before anything is installed.

  - a local wheel: pip's configured find-links (pip.conf, PIP_FIND_LINKS) hold a torch wheel of the lock's version
    that this interpreter can install and of the build the machine wants: that file (a CPU build with --no-deps; a
    CUDA build with its dependencies, the nvidia libraries);
  - macOS: PyPI's wheel (its CPU and MPS build), --no-deps;
  - Linux without a GPU: PyTorch's CPU build, `torch==V+cpu` from https://download.pytorch.org/whl/cpu, --no-deps
    (PyPI's Linux wheel is the CUDA build, which without its nvidia libraries does not import);
  - Linux where `nvidia-smi -L` lists a GPU: PyPI's CUDA build with its dependencies (the nvidia libraries), a local
    CPU wheel in find-links excluded by version.

DPPO_TORCH overrides the choice: auto (the default, the above), local (the local wheel, whatever its build; an error
when there is none), cpu, cuda, or skip (install no torch: the environment's own is kept).
"""

from __future__ import annotations

import ast
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CHOICES = ("auto", "local", "cpu", "cuda", "skip")


@dataclass(frozen=True)
class Decision:
    build: str  # "cpu" or "cuda": the build torch is (or, with skip, the one this machine would get)
    source: str  # "local", "pytorch-cpu", "pypi" or "skip"
    pip_args: tuple[str, ...]  # after `pip install`; empty for skip
    reason: str


def parse_wheel(name: str) -> tuple[str, str, str, frozenset[str]] | None:
    """(distribution, public version, local label, tags) of a wheel's file name, or None when it is not a wheel."""
    if not name.endswith(".whl"):
        return None
    parts = name[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    dist, version, pys, abis, plats = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    public, _, local = version.partition("+")
    tags = frozenset(f"{p}-{a}-{pl}" for p in pys.split(".") for a in abis.split(".") for pl in plats.split("."))
    return dist.lower().replace("_", "-"), public, local, tags


def wheel_build(label: str, system: str) -> str:
    """The build of a torch wheel from its local label: +cpu and macOS wheels are CPU builds, +cuXXX and PyPI's
    unlabelled Linux wheel CUDA builds; anything else (rocm, xpu) is named by its label and never chosen by auto."""
    if label == "cpu" or label.startswith("cpu."):
        return "cpu"
    if re.fullmatch(r"cu\d+", label):
        return "cuda"
    if not label:
        return "cpu" if system in ("Darwin", "Windows") else "cuda"
    return label


def decide(*, system: str, machine: str, has_gpu: bool, local_wheels: list[str | Path], supported_tags: set[str],
           version: str, override: str = "auto") -> Decision:
    """The torch build for a machine and the pip arguments that install torch==version (version without a label).

    system, machine: platform.system(), platform.machine(). has_gpu: `nvidia-smi -L` lists a GPU. local_wheels: the
    torch wheels in pip's find-links folders (any version or tags: the ones that fit are picked here).
    supported_tags: this interpreter's wheel tags ("cp311-cp311-manylinux_2_28_x86_64", ...). override: DPPO_TORCH.
    Raises ValueError for an override that cannot be honoured."""
    override = (override or "auto").strip().lower()
    if override not in CHOICES:
        raise ValueError(f"DPPO_TORCH={override!r}: expected one of {', '.join(CHOICES)}")
    macos = system == "Darwin"
    wanted = "cuda" if has_gpu and not macos else "cpu"
    fitting = []  # (path, build) of local wheels of this version this interpreter can install
    for path in local_wheels:
        parsed = parse_wheel(Path(path).name)
        if parsed and parsed[0] == "torch" and parsed[1] == version and parsed[3] & supported_tags:
            fitting.append((str(path), wheel_build(parsed[2], system)))
    if override == "skip":
        return Decision(wanted, "skip", (), "DPPO_TORCH=skip: no torch installed (the environment's own is kept)")
    if override == "local":
        if not fitting:
            raise ValueError(f"DPPO_TORCH=local: pip's find-links hold no torch=={version} wheel for this "
                             f"interpreter ({len(local_wheels)} torch wheel(s) there)")
        path, build = sorted(fitting, key=lambda f: f[1] != wanted)[0]
        return Decision(build, "local", ("--no-deps", path) if build == "cpu" else (path,),
                        f"DPPO_TORCH=local: the local wheel {Path(path).name} ({build} build)")
    build = wanted if override == "auto" else override
    why = f"DPPO_TORCH={override}" if override != "auto" else (
        "nvidia-smi lists a GPU" if build == "cuda" else ("macOS" if macos else "no GPU (nvidia-smi lists none)"))
    if macos and build == "cuda":
        raise ValueError("DPPO_TORCH=cuda: PyTorch has no CUDA build for macOS")
    local = [path for path, b in fitting if b == build]
    if local:
        return Decision(build, "local", ("--no-deps", local[0]) if build == "cpu" else (local[0],),
                        f"{why}: the local {build} wheel {Path(local[0]).name} (pip's find-links)")
    if macos:
        return Decision("cpu", "pypi", ("--no-deps", f"torch=={version}"),
                        f"{why}: PyPI's torch {version} for macOS {machine} (its CPU and MPS build)")
    if build == "cpu":
        return Decision("cpu", "pytorch-cpu", ("--no-deps", "--index-url", CPU_INDEX, f"torch=={version}+cpu"),
                        f"{why}, no local wheel: PyTorch's CPU build from {CPU_INDEX}")
    # PyPI's CUDA build, with its nvidia libraries. torch==V also matches a local V+cpu in find-links (and prefers
    # it: a local label sorts higher), so each such label is excluded by name.
    other = set()
    for path in local_wheels:
        parsed = parse_wheel(Path(path).name)
        if parsed and parsed[0] == "torch" and parsed[1] == version and parsed[2] \
                and wheel_build(parsed[2], system) != "cuda":
            other.add(parsed[2])
    spec = ",".join([f"torch=={version}"] + [f"!={version}+{label}" for label in sorted(other)])
    return Decision("cuda", "pypi", (spec,), f"{why}: PyPI's CUDA build of torch {version} with its nvidia libraries")


# --- probing the real machine (the tests run main() with a fake find-links folder) ---

def has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def find_links_dirs(python: str = sys.executable) -> list[Path]:
    """The local folders among pip's find-links, as this interpreter's pip sees them (pip.conf files, PIP_FIND_LINKS,
    PIP_CONFIG_FILE=/dev/null: `pip config list` reports what pip itself reads; the environment's value first)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    values: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.endswith(".find-links"):
            try:
                values[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                values[key] = value.strip("'\"")
    # pip install's precedence: the environment, then the files' [install] section, then their [global] one (pip
    # config list shows the files already merged); like pip, an empty value is ignored (PIP_FIND_LINKS= hides nothing)
    chosen = next((values[k] for k in (":env:.find-links", "install.find-links", "global.find-links")
                   if values.get(k, "").strip()), "")
    dirs = []
    for entry in chosen.split():
        url = urlparse(entry)
        path = Path(unquote(url.path)) if url.scheme == "file" else (Path(entry) if not url.scheme else None)
        if path is not None and path.is_dir():
            dirs.append(path)
    return dirs


def supported_tags() -> set[str]:
    try:
        from packaging import tags
    except ImportError:  # a fresh venv: pip's own copy
        from pip._vendor.packaging import tags
    return {str(t) for t in tags.sys_tags()}


def lock_version(root: Path) -> str:
    for line in (root / "requirements" / "lock.txt").read_text().splitlines():
        if line.lower().startswith("torch=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit("requirements/lock.txt has no torch== line")


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    dirs = find_links_dirs()
    wheels = [p for d in dirs for p in sorted(d.glob("torch-*.whl"))]
    facts = dict(system=platform.system(), machine=platform.machine(), has_gpu=has_nvidia_gpu(), local_wheels=wheels,
                 supported_tags=supported_tags(), version=lock_version(root))
    try:
        decision = decide(**facts, override=os.environ.get("DPPO_TORCH", "auto"))
    except ValueError as err:
        print(f"[dppo] torch: {err}", file=sys.stderr)
        return 2
    print(f"[dppo] torch {facts['version']} ({facts['system']} {facts['machine']}, GPU: {facts['has_gpu']}, "
          f"find-links: {', '.join(map(str, dirs)) or 'none'}): {decision.reason}", file=sys.stderr)
    print(decision.build)
    for arg in decision.pip_args:
        print(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

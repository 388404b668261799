"""Reading traced programs in the tests: every equation of a jaxpr, nested programs included."""

from typing import Any


def equations(jaxpr: Any, out: list | None = None) -> list:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (jit, shard_map, cond, loops), in order."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    equations(inner, out)
    return out

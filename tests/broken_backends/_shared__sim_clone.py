"""Helpers of the broken sim backends (installed as module ``sim_clone`` next to them).

A broken sim backend subclasses the sim backend's hook class and overrides one hook; the
module exports every hook of an instance as a module-level function, so the backend is the
module its entry point names, as the other broken backends are. Its identity (``device_type``
``sim``) is appended on install (tests/broken_backends/__init__.py).
"""

from typing import Any

from ds_backend_sim.plugin import NAME, SimHooks, _determinism, _module


def export(cls: type[SimHooks], into: dict[str, Any]) -> SimHooks:
    """Instantiate ``cls`` as the sim backend does and put its ``ds_*`` hooks in ``into``,
    except the identity hook, which the installer writes."""
    hooks = cls(NAME, _module, api_name="torch.sim", determinism=_determinism)
    for name in dir(hooks):
        if name.startswith("ds_") and name != "ds_backend_info":
            into[name] = getattr(hooks, name)
    return hooks

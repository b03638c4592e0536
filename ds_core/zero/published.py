"""Stages 1-2 with ``overlap_comm``: the after-step all-gathers finish under the next forward.

[Note: deferred after-step gathers]
After the optimizer's step each rank holds the updated values of its own range of every
SHARDED_STATE unit; one all-gather per unit rebuilds the rest (:meth:`Updater.publish
<ds_core.zero.steps.Updater.publish>`). Waiting for those gathers at the end of ``step()``
puts them on the critical path with no compute to hide behind: on the sim link model they
were half the step's communication and bounded exposed communication at about 0.5
(bench/README.md, "overlap.py"). With ``overlap_comm`` every gather is issued on the comm
stream and left in flight; a forward pre-hook on each module that directly owns parameters of
a unit makes the compute stream wait for that unit's gather just before the module runs, as
stage 3 waits for its prefetched gathers per module (:mod:`ds_core.zero.stage3`). The waits
are stream waits (the comm hookspec's ``wait()``): no host sync is added to the step.

So, as at stage 3, a parameter must be used inside the forward of a module that owns it (or
after that module ran in the same forward): a module reading another module's parameter
before that module ran would read it mid-gather. Everything that reads parameters outside a
forward waits for every pending gather first (:meth:`PublishedGathers.drain`): the engine's
``module`` (hence ``parameters()``, ``state_dict()``, ``eval()`` and a user's
``engine.module.parameters()``), checkpoints, state dicts, ``sync_params_from_masters`` and
the next ``publish`` (which writes the ranges those gathers read). The end of each forward
drains the gathers of units no module used. A reference to the model kept from before
``initialize`` bypasses this: read the parameters through the engine.

Each gather holds a copy of this rank's range until its wait (the collective never reads the
buffer it writes, see :meth:`FlatUnit.all_gather <ds_core.zero.partition.FlatUnit.all_gather>`):
4Ψ/N bytes at fp32 live from the step to the forward that consumes them, where without
``overlap_comm`` at most two copies are.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_core.zero.partition import FlatUnit, InFlight, SideStream


class PublishedGathers:
    """The after-step all-gathers still in flight, and the forward pre-hooks that wait for
    them (see [Note: deferred after-step gathers]).

    :param module: the root module; each submodule that directly owns a parameter of one of
        ``units`` gets a forward pre-hook.
    :param units: the SHARDED_STATE units all-gathered after each step.
    """

    def __init__(self, module: nn.Module, units: list[FlatUnit]) -> None:
        self.units = units
        self._pending: dict[int, InFlight] = {}
        #: the side stream the gathers run on (made at the first step).
        self._side = SideStream()
        owner: dict[int, FlatUnit] = {}
        for unit in units:
            for zp in unit.zparams:
                owner[id(zp.param)] = unit
        #: module -> the units of its direct parameters.
        self._module_units: dict[nn.Module, list[FlatUnit]] = {}
        for sub in module.modules():
            mine: list[FlatUnit] = []
            for p in sub._parameters.values():
                found = owner.get(id(p)) if p is not None else None
                if found is not None and found not in mine:
                    mine.append(found)
            if mine:
                self._module_units[sub] = mine
        self._handles: list[RemovableHandle] = [
            sub.register_forward_pre_hook(self._pre_forward) for sub in self._module_units
        ]
        # the end of the root's forward: units no module of this forward used
        self._handles.append(module.register_forward_hook(lambda *_: self.drain()))

    @property
    def pending(self) -> int:
        """Gathers issued and not yet waited for."""
        return len(self._pending)

    def issue(self) -> None:
        """All-gather every unit asynchronously on the comm stream, ordered after the work
        queued so far on the current stream (the writes of the owned ranges); the previous
        step's gathers are drained first."""
        self.drain()
        with self._side.after_current():
            for unit in self.units:
                self._pending[id(unit)] = unit.all_gather(async_op=True)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._pending:
            for unit in self._module_units[module]:
                rec = self._pending.pop(id(unit), None)
                if rec is not None:
                    rec.wait()

    def drain(self) -> None:
        """Order the current stream after every pending gather (a stream wait, not a host
        sync); the parameters are whole for any work queued after this."""
        pending, self._pending = self._pending, {}
        for rec in pending.values():
            rec.wait()

    def remove(self) -> None:
        """Drain, then remove every hook (engine teardown). The host waits for the comm
        stream here (teardown is no step): the units' buffers are freed next, and a
        collective still running on that stream would write into them."""
        self.drain()
        self._side.synchronize()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._module_units.clear()

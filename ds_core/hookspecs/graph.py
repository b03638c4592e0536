"""Graph capture: record a sequence of device work once, replay it cheaply."""

from __future__ import annotations

from ds_core.hookspecs._contract import FACADE, MAY_CREATE_CONTEXT, OPTIONAL, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import Graph


@hookspec(firstresult=True)
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked("Device context: may create one", MAY_CREATE_CONTEXT)
@unchecked(
    "Outputs are defined only after a replay",
    "promises nothing: a permission (the work may or may not run during capture), so callers read outputs only after a replay",
)
def ds_graph_create() -> Graph:
    """Create an empty graph object (see :class:`ds_core.types.Graph`).

    Inside ``graph.capture()`` the work is recorded; ``replay()`` re-runs it reading the same
    input storage and writing the same output storage, so mutating a static input between
    replays changes the outputs. Outputs are defined only after a replay: whether the work also
    runs during capture is the vendor's choice (a CUDA graph runs nothing until replayed).
    Replay repeats the recorded device work, not changes of tensor metadata: a view made in
    place during capture (``unsqueeze_``, ``transpose_``) changes the tensor's shape once, at
    capture, as a CUDA graph replays kernels only. A graph that is capturing refuses to capture
    again: entering its ``capture()`` inside its own raises.
    Whether capture succeeds or raises, leaving ``capture()`` restores the current stream and
    the generators' state as they were before it. Work that cannot be replayed faithfully (an op the vendor
    cannot capture, a host synchronisation, data-dependent shapes) makes capture raise, never
    fall back to eager execution. The facade refuses to call this hook until graph capture is
    enabled for this backend by name (``Accelerator.configure``).

    Device context: may create one.

    Use in backends: optional; required with the ``graph_capture`` capability.
    Facade: ``create_graph()``, ``capture_to_graph(g)``, ``replay_graph(g)``.
    """

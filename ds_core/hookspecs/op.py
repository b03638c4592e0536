"""Op providers: accelerated implementations of operators (fused Adam, ...)."""

from __future__ import annotations

from typing import Final

from ds_core.hookspecs._contract import CALLED_BY_CORE, FACADE, OPTIONAL, unchecked
from ds_core.hookspecs._markers import hookspec
from ds_core.types import OpProvider

#: Sentences of this module's docstring that no conformance check reads, and why
#: (ds_core/hookspecs/_contract.py).
UNCHECKED_SECTION: Final[dict[str, str]] = {
    "Op providers: accelerated implementations of operators": "promises nothing: a summary of the section; its sentences below carry the promises",
}


@hookspec
@unchecked("Facade:", FACADE)
@unchecked("Use in backends: optional", OPTIONAL)
@unchecked(
    "Compiled ops are built through",
    "promises nothing: guidance for backend authors on building ops",
)
@unchecked("Called on every plugin; results are concatenated, later plugins first.", CALLED_BY_CORE)
def ds_op_providers() -> list[OpProvider]:
    """Return the op providers this plugin offers (see :class:`ds_core.types.OpProvider`).

    Called on every plugin; results are concatenated, later plugins first. Calling this hook
    and ``is_compatible`` must not build, load, or touch a device; ``load`` may do all three,
    and must let ``KeyboardInterrupt`` propagate out of any build it runs.

    Well-known names: ``"fused_adam"`` (a ``torch.optim.Optimizer`` class with AdamW's
    arguments), ``"cpu_adam"`` (host Adam for optimizer offload: a ``torch.optim.Optimizer``
    class with DeepSpeed's ``DeepSpeedCPUAdam`` arguments, AdamW by default), ``"quantizer"``
    (the arithmetic of the compressed collectives: an object with the methods of
    ``ds_core.ops.quantizer.Quantizer``, symmetric block quantization and 1-bit compression;
    ``ds_core.ops.quantizer.quantizer_provider()`` is the host one).

    Compiled ops are built through :mod:`ds_core.ops` (one per-user cache, lock, hash scheme
    and toolchain probe); ``ds_core.ops.cpu_adam.cpu_adam_provider()`` is a ready provider
    any backend can return. A provider may also have ``status() -> str`` saying which
    implementation is active or would be and whether it is built; ``ds-core report`` shows it.
    ``status`` may run the toolchain probe but must not build or touch a device.

    Device context: never (``load`` may create one).

    Use in backends: optional. Facade: ``op_providers()``, ``get_op(name)``.
    """

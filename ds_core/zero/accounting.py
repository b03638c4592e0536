"""What the engine's model states cost, counted from its own buffers (never from the
process's resident set, which keeps freed small tensors; docs/architecture.md §3.5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ds_core.zero.partition import Mode

if TYPE_CHECKING:  # the engine imports this module
    from ds_core.zero.engine import ZeroEngine


def model_state_bytes(engine: ZeroEngine) -> dict[str, int]:
    """Bytes of this rank's model states, summed over the engine's own buffers.

    Keys: ``params`` (full or partitioned parameters, padding included), ``master`` (fp32
    masters that are separate copies; 0 when parameters are fp32 and serve as their own),
    ``grads`` (persistent gradient accumulators; the reusable staging buffers of
    ``reduce_bucket_size`` elements are apart, in ``reducer.staging_bytes()``), ``optimizer`` (optimizer state tensors),
    ``total``. Gathered stage-3 parameters are transient and not counted.

    With optimizer offload the masters and the optimizer state are on the host: ``master``
    and ``optimizer`` count only what stays on the device (nothing), and ``host_master``,
    ``host_grads`` (the fp32 ranges the host optimizer reads), ``host_staging`` (the
    16-bit staging buffer), ``host_optimizer`` and ``host_total`` count the host side.
    With parameter offload the stage-3 shards are on the host: ``params`` leaves them out and
    ``host_params`` counts them (included in ``host_total`` when the optimizer is offloaded too).
    With NVMe parameter offload, swapped shards count nothing: ``host_params`` counts the
    shards kept in host memory (``max_in_cpu``) plus the swap buffer pool, which is also
    reported alone as ``host_param_swap``.
    """
    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None or t.numel() == 0:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    params = sum(
        size(u.shard if u.mode is Mode.PARTITIONED else u.flat)
        for u in engine.units
        if not u.host_shard
    )
    host_params = sum(size(u.shard) for u in engine.units if u.host_shard and not u.swapper)
    swap = engine.param_swap.pool_bytes() if engine.param_swap is not None else 0
    host_params += swap
    for zp in engine.zparams.values():
        if zp.unit is None:
            params += size(zp.param.data)
    offload = engine.offload
    master = sum(
        size(zp.master.data)
        for zp in engine._trainable
        if zp.master is not None and (offload is None or not offload.holds(zp.unit))
    )
    grads = engine.reducer.nbytes()
    opt = 0
    for state in engine.optimizer.state.values() if engine.optimizer is not None else ():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                opt += size(v)
    out = {"params": params, "master": master, "grads": grads, "optimizer": opt}
    if offload is not None:
        host = offload.host_bytes()
        out["optimizer"] = 0
        out.update(
            host_master=host["master"],
            host_grads=host["grads"],
            host_staging=host["staging"],
            host_optimizer=opt,
            host_total=host["master"] + host["grads"] + host["staging"] + opt,
        )
    if any(u.host_shard for u in engine.units):
        out["host_params"] = host_params
        if engine.param_swap is not None:
            out["host_param_swap"] = swap
        if offload is not None:
            out["host_total"] += host_params
    out["total"] = params + master + grads + out["optimizer"]
    return out

"""Broken: capture looks up each result's aliasing by its position among the schema's returns.

An op returning a list of tensors (``split``, ``chunk``, ``unbind``) has one schema return for
the whole list, so capturing ``x.chunk(4)`` indexes past the returns and fails (the mutant
``i < len(aliases)`` -> ``i != len(aliases)`` that the mutation tool found surviving).
"""

from typing import Any

import torch
from ds_backend_cpu import graph as _graph
from ds_backend_cpu.plugin import *  # noqa: F403 - every cpu hook, re-exported
from torch.utils._pytree import tree_flatten, tree_map

from ds_core import hookimpl
from ds_core.types import BackendInfo  # noqa: F401 - used by the identity appended on install


class _MisindexedRecorder(_graph._Recorder):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for tag, why in _graph._REFUSED_TAGS.items():
            if tag in func.tags:
                raise _graph.GraphCaptureError(f"cannot capture {func}: it {why}")
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
                raise _graph.GraphCaptureError(f"cannot capture {func} on a {leaf.layout} tensor")
        pinned_args, pinned_kwargs = tree_map(_graph._pin, (args, kwargs))
        out = func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(r, torch.Tensor) for r in results):
            raise _graph.GraphCaptureError(f"cannot capture {func}: it returns a host value")
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        aliases = [r.alias_info is not None for r in schema.returns]
        rerun = torch.Tag.inplace_view not in func.tags and (writes or not all(aliases))
        outputs = tuple(None if aliases[i] else _graph._pin(r) for i, r in enumerate(results))
        self.steps.append(_graph._Step(func, pinned_args, pinned_kwargs, rerun, outputs))
        return out


_graph._Recorder = _MisindexedRecorder  # type: ignore[misc]


@hookimpl
def ds_graph_create() -> Any:
    return _graph.CpuGraph()

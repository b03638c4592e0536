"""Model parallelism beside ZeRO's data parallelism, one subpackage per kind.

- :mod:`ds_core.parallel.tensor`: AutoTP, tensor parallelism applied to an unmodified model;
- :mod:`ds_core.parallel.expert`: expert parallelism (the expert-parameter marker, the MoE
  layer; AutoEP is :mod:`ds_core.zero.autoep`).

The process groups of every kind come from :func:`ds_core.comm.device_mesh` and
:mod:`ds_core.comm.groups`; the ZeRO engine partitions and reduces each parameter over the
data-parallel group its kind implies.
"""

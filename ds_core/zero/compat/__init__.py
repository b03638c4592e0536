"""The DeepSpeed-compatible surface of the engine.

- :mod:`~ds_core.zero.compat.entry`: ``initialize`` and ``add_config_arguments``;
- :mod:`~ds_core.zero.compat.engine_api`: ``DeepSpeedEngine``'s methods and properties beyond
  the training step;
- :mod:`~ds_core.zero.compat.builders`: optimizers and LR schedules built from the config;
- :mod:`~ds_core.zero.compat.throughput`: DeepSpeed's throughput timer;
- :mod:`~ds_core.zero.compat.guards`: refusals of model and call patterns the engine cannot honour.
"""

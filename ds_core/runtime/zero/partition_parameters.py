"""``deepspeed.runtime.zero.partition_parameters``: ``GatheredParameters`` (ds_core's) and
``Init`` with DeepSpeed's keyword arguments over :class:`ds_core.zero.Init`.

``Init`` takes DeepSpeed's arguments so ``Init(config_dict_or_path=ds_config)`` (how
transformers and Lightning call it) works; the config is not needed to partition (the engine
reads it at ``initialize``), so it is accepted and not read. Arguments that would change where
or how parameters live and that ds_core does not implement are refused unless left at their
defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_core.errors import ConfigError
from ds_core.zero.gathered import GatheredParameters
from ds_core.zero.partitioned_init import Init as _Init

__all__ = ["GatheredParameters", "Init"]


class Init(_Init):
    """``deepspeed.zero.Init``'s constructor over :class:`ds_core.zero.Init`.

    :param config_dict_or_path: the DeepSpeed config (dict or path); accepted, not read.
    :param config: DeepSpeed's older name for it; accepted, not read.
    :param enabled: ``False`` makes the context do nothing.
    :param dtype: accepted when ``None`` (parameters keep the dtype the model builds them in).
    :raises ConfigError: for ``module``, ``data_parallel_group``, ``remote_device``
        other than ``None``/``"none"``, ``pin_memory``, ``mpu``, a parameter group, quantized
        weights, a sequence group or a swapper.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        refused = {
            "module": module is not None,
            "data_parallel_group": data_parallel_group is not None,
            "remote_device": remote_device not in (None, "none"),
            "pin_memory": bool(pin_memory),
            "dtype": dtype is not None,
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
        }
        given = [name for name, bad in refused.items() if bad]
        if enabled and given:
            raise ConfigError(
                f"zero.Init({', '.join(given)}=...) is not supported by ds_core; "
                "ds_core.zero.Init partitions over the data-parallel world as modules are built "
                "(offload is configured in the config's zero_optimization section)"
            )
        self.config_dict_or_path = (
            config_dict_or_path if config_dict_or_path is not None else config
        )
        self.mem_efficient_linear = mem_efficient_linear
        super().__init__(enabled=enabled)

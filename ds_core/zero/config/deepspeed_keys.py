"""DeepSpeed config keys that are not fields of :class:`~ds_core.zero.config.DSConfig`.

Performance knobs that change no result in this design are accepted and named in one warning;
keys that would change results but are not implemented are errors ("not supported yet"),
unless set to their no-op value (``offload_optimizer.device: "none"``), which counts as a knob.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["NOT_YET", "dotted", "extra_keys", "strip_known_extras"]

#: section path -> knobs that change no result in this design; accepted with one warning
_IGNORED: dict[tuple[str, ...], frozenset[str]] = {
    (): frozenset(
        {
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "flops_profiler",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "comet",
            "comms_logger",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "disable_allgather",
            "timers",
            "cuda_visible_devices",
            # DeepSpeed 0.19.8: Python's cyclic GC off during training; an alignment warning
            "disable_python_gc",
            "vocabulary_size",
        }
    ),
    ("zero_optimization",): frozenset(
        {
            "contiguous_gradients",
            "reduce_scatter",
            "round_robin_gradients",
            "allgather_partitions",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "use_multi_rank_bucket_allreduce",
            "memory_efficient_linear",
            "stage3_module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "legacy_stage1",
            "log_trace_cache_warnings",
            "gather_16bit_weights_on_model_save",
            # DeepSpeed 0.19.8 stage-3 fetch / layout / debugging knobs: which parameters stay
            # whole, how gathers are grouped, padding, sanity checks; no value changes a result
            "stage3_model_persistence_threshold",
            "stage3_allgather_sequential",
            "parameter_alignment",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
        }
    ),
    # CPU cores cpu_adam may use (SuperOffload's knob)
    ("zero_optimization", "offload_optimizer"): frozenset({"cpuadam_cores_perc"}),
    # DeepSpeed's BF16_Optimizer adds every micro-batch's bf16 gradient into fp32 either way
    # (hooks when true, after backward when false); ds_core accumulates in fp32 too.
    ("bf16",): frozenset({"immediate_grad_update"}),
    ("tensor_parallel",): frozenset({"tp_overlap_comm"}),
    # grouped GEMM is a kernel choice; the experts compute the same values one by one
    ("expert_parallel",): frozenset(
        {
            "use_grouped_mm",
            "grouped_mm_backend",
            "disable_triton_grouped_mm",
            # how DeepSpeed's kernels combine the same terms, and its DeepEP transport's knobs
            "combine_impl",
            "row_weighting_impl",
            "gate_up_impl",
            "comm_num_sm",
            "comm_qp_margin",
            "comm_max_tokens_per_rank",
            # extra routing cross-checks and an asynchronous split plan: same routing
            "validate_folding_routing",
            "async_split_plan",
        }
    ),
}

NOT_YET = "not supported yet"

#: section path -> keys that would change results and are not implemented
_UNSUPPORTED: dict[tuple[str, ...], frozenset[str]] = {
    (): frozenset(
        {
            "amp",
            "data_types",
            "sparse_attention",
            "sparse_gradients",
            "compression_training",
            "quantize_training",
            "curriculum_learning",
            "data_efficiency",
            "elasticity",
            "autotuning",
            "checkpoint",
            "hybrid_engine",
            "seq_parallel_communication_data_type",
            "eigenvalue",
            "progressive_layer_drop",
            "nebula",
            "gradient_allreduce_op",
            "fp32_allreduce",
            "compile",
            "managed_gradient_accumulation",
            "use_data_before_expert_parallelism",
            "weight_quantization",
        }
    ),
    ("zero_optimization",): frozenset(
        {
            "zero_quantized_nontrainable_weights",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "zeropp_loco_param",
            "pipeline_loading_checkpoint",
            "compute_grad_norm",
            "zenflow",
        }
    ),
    ("zero_optimization", "offload_optimizer"): frozenset({"super_offload"}),
    ("fp16",): frozenset({"consecutive_hysteresis", "fp16_master_weights_and_grads"}),
    ("tensor_parallel",): frozenset(
        {
            "tp",
            "preset_model",
            "dtype",
            "injection_policy_tuple",
            "keep_module_on_host",
            "replace_with_kernel_inject",
            "kernel_inject",
            "vocab_parallel_lm_head",
            "vocab_parallel_ce_backend",
        }
    ),
    ("expert_parallel",): frozenset(
        {
            "expert_tensor_parallel_size",
            "comm_backend",
            "shared_experts_gate_pattern",
            "expert_activation",
        }
    ),
}

#: (section path, key) -> test that the value requests nothing (DeepSpeed's default / "off")
_NO_OP_VALUES: dict[tuple[tuple[str, ...], str], Callable[[Any], bool]] = {
    ((), "fp32_allreduce"): lambda v: v is False,
    ((), "sparse_gradients"): lambda v: v is False,
    ((), "gradient_allreduce_op"): lambda v: v == "mean",
    (("fp16",), "consecutive_hysteresis"): lambda v: v is False,
    # DeepSpeed's defaults (DeepSpeedZeroConfig, TPTrainingConfig): off, so nothing asked for
    (("zero_optimization",), "zero_quantized_nontrainable_weights"): lambda v: v is False,
    (("zero_optimization",), "pipeline_loading_checkpoint"): lambda v: v is False,
    (("tensor_parallel",), "keep_module_on_host"): lambda v: v is False,
    (("tensor_parallel",), "replace_with_kernel_inject"): lambda v: v is False,
    (("tensor_parallel",), "kernel_inject"): lambda v: v is False,
    (("tensor_parallel",), "preset_model"): lambda v: v is None,
    (("tensor_parallel",), "injection_policy_tuple"): lambda v: v is None,
    (("tensor_parallel",), "vocab_parallel_lm_head"): lambda v: v is None or v is False,
    (("tensor_parallel",), "vocab_parallel_ce_backend"): lambda v: v == "torch",
    ((), "managed_gradient_accumulation"): lambda v: v is True,
    ((), "use_data_before_expert_parallelism"): lambda v: v is False,
    (("zero_optimization",), "compute_grad_norm"): lambda v: v is True,
    (("zero_optimization",), "zenflow"): lambda v: v is None,
    (("zero_optimization", "offload_optimizer"), "super_offload"): lambda v: v is False,
    (("expert_parallel",), "expert_tensor_parallel_size"): lambda v: v == 1,
    (("expert_parallel",), "comm_backend"): lambda v: v == "comm",
    (("expert_parallel",), "shared_experts_gate_pattern"): lambda v: v is None,
    (("expert_parallel",), "expert_activation"): lambda v: v is None,
    ((), "amp"): lambda v: _disabled(v),
    ((), "hybrid_engine"): lambda v: _disabled(v),
    ((), "compile"): lambda v: isinstance(v, dict) and not any(x is True for x in v.values()),
    # ds_core accumulates gradients in fp32 always: only that choice is a no-op.
    # param_dtype / buffer_dtype None: the training precision's dtype / the buffers' own.
    ((), "data_types"): lambda v: (
        isinstance(v, dict)
        and set(v) <= {"grad_accum_dtype", "param_dtype", "buffer_dtype"}
        and v.get("grad_accum_dtype") in (None, "fp32", "float32")
        and v.get("param_dtype") is None
        and v.get("buffer_dtype") is None
    ),
    (("fp16",), "fp16_master_weights_and_grads"): lambda v: v is False,
}

#: (section path, key) -> the feature a refused value asks for, named in the error
_FEATURES: dict[tuple[tuple[str, ...], str], str] = {
    (("fp16",), "fp16_master_weights_and_grads"): (
        "true asks for fp16 master weights and fp16 gradients (DeepSpeed: ZeRO stages 1-3 with "
        "DeepSpeedCPUAdam); ds_core keeps fp32 masters and accumulates gradients in fp32, and "
        "low-precision master states are not supported yet; set it to false or remove it"
    ),
}


def _disabled(value: Any) -> bool:
    """A section whose ``enabled`` is false (or absent: DeepSpeed's default is off)."""
    return isinstance(value, dict) and value.get("enabled", False) is False


def dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path) or "<config>"


def strip_known_extras(
    raw: dict[str, Any], path: tuple[str, ...], ignored: list[str], errors: list[str]
) -> dict[str, Any]:
    """Remove ignored knobs and no-op values from one section, recording them."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        here = (*path, key)
        if key in _IGNORED.get(path, frozenset()):
            ignored.append(dotted(here))
        elif key in _UNSUPPORTED.get(path, frozenset()):
            no_op = _NO_OP_VALUES.get((path, key))
            if no_op is not None and no_op(value):
                ignored.append(dotted(here))
            elif (path, key) in _FEATURES:
                errors.append(f"{dotted(here)}: {_FEATURES[(path, key)]}")
            else:
                errors.append(
                    f"{dotted(here)}: {NOT_YET} (this key would change training results "
                    f"and ds_core does not implement it); remove it"
                )
        else:
            out[key] = value
    return out


def extra_keys(section: tuple[str, ...]) -> frozenset[str]:
    """Keys of ``section`` that are not fields but are known (knobs and not-yet features)."""
    return _IGNORED.get(section, frozenset()) | _UNSUPPORTED.get(section, frozenset())

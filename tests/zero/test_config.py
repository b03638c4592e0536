"""The config schema: DeepSpeed names and defaults, every validation rule and its message,
batch-size derivation (the optimizer and scheduler sections: test_config_builders.py)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from ds_core import ConfigError
from ds_core.zero.config import DSConfig, load_config


def error_of(config: Any, world_size: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# defaults


def test_defaults_follow_deepspeed() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2}, world_size=1)
    # DeepSpeed 0.19.8, runtime/constants.py: GRADIENT_CLIPPING_DEFAULT = 1.0
    assert cfg.gradient_clipping == 1.0
    # STEPS_PER_PRINT_DEFAULT and LOG_LEVEL_DEFAULT are None there: no progress line, the
    # logger's level left alone (the whole table: tests/zero/test_deepspeed_defaults.py)
    assert cfg.steps_per_print is None
    assert cfg.log_level is None
    assert cfg.precision == "fp32"
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power) == (False, 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    assert cfg.bf16.enabled is False and cfg.bf16.check_grad_overflow is True
    z = cfg.zero_optimization
    assert z.stage == 0
    # ds_core's measured deviations here (tests/zero/test_deepspeed_defaults.py says why)
    assert z.reduce_bucket_size == 5_000_000
    assert z.allgather_bucket_size == 500_000_000
    assert z.overlap_comm is False
    assert z.stage3_prefetch_bucket_size is None  # the engine's rule (ds_core/zero/stage3.py)
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_max_live_parameters == 1_000_000_000
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.accelerator == {}


def test_overlap_comm_defaults_to_true_only_at_stage_3() -> None:
    assert load_config({"zero_optimization": {"stage": 3}}, 1).zero_optimization.overlap_comm
    assert not load_config({"zero_optimization": {"stage": 2}}, 1).zero_optimization.overlap_comm
    cfg = load_config({"zero_optimization": {"stage": 3, "overlap_comm": False}}, 1)
    assert cfg.zero_optimization.overlap_comm is False


def test_config_is_frozen() -> None:
    cfg = load_config(None, 1)
    with pytest.raises(ValueError, match="frozen"):
        cfg.gradient_clipping = 0.0  # type: ignore[misc]


def test_json_numbers_in_exponent_form_are_integers() -> None:
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": 2e8}}, 1)
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


def test_accelerator_section_is_per_backend_options() -> None:
    cfg = load_config({"accelerator": {"cpu": {"threads": 1}}}, 1)
    assert cfg.accelerator == {"cpu": {"threads": 1}}
    assert "accelerator.cpu" in error_of({"accelerator": {"cpu": 3}})


# ---------------------------------------------------------------------------------------------
# batch sizes


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, 2, (24, 4, 3)),
        ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 24}, 4, (24, 6, 1)),
        ({"train_micro_batch_size_per_gpu": 5}, 3, (15, 5, 1)),
        ({"gradient_accumulation_steps": 2}, 2, (4, 1, 2)),
        ({}, 2, (2, 1, 1)),
        (
            {
                "train_batch_size": 48,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 3,
            },
            4,
            (48, 4, 3),
        ),
    ],
)
def test_any_two_batch_sizes_determine_the_third(
    given: dict[str, int], world_size: int, expected: tuple[int, int, int]
) -> None:
    cfg = load_config(given, world_size)
    got = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert got == expected


def test_inconsistent_batch_sizes_name_all_three_and_world_size() -> None:
    msg = error_of(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        world_size=2,
    )
    assert "train_batch_size (32)" in msg
    assert "train_micro_batch_size_per_gpu (4)" in msg
    assert "gradient_accumulation_steps (2)" in msg
    assert "world_size (2)" in msg
    assert "= 16" in msg


def test_indivisible_batch_sizes_are_errors() -> None:
    msg = error_of({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert "train_batch_size (30) is not divisible" in msg and "world_size (2) = 8" in msg
    msg = error_of({"train_batch_size": 9, "gradient_accumulation_steps": 2}, world_size=2)
    assert "train_micro_batch_size_per_gpu cannot be derived" in msg


@pytest.mark.parametrize("bad", [0, -4, True, 2.5, "8"])
def test_batch_sizes_must_be_positive_integers(bad: Any) -> None:
    msg = error_of({"train_micro_batch_size_per_gpu": bad})
    assert msg.startswith("invalid ds_core config: train_micro_batch_size_per_gpu: ")
    assert ("must be > 0" in msg) or ("must be an integer" in msg)


def test_world_size_must_be_a_positive_integer() -> None:
    with pytest.raises(ConfigError, match="world_size must be an integer >= 1, got 0"):
        load_config(None, 0)


# ---------------------------------------------------------------------------------------------
# scalar fields


def test_gradient_clipping_zero_disables_and_negative_is_an_error() -> None:
    assert load_config({"gradient_clipping": 0}, 1).gradient_clipping == 0.0
    assert "gradient_clipping: must be >= 0, got -1.0" in error_of({"gradient_clipping": -1})
    assert "gradient_clipping: must be finite, got inf" in error_of({"gradient_clipping": math.inf})
    assert "gradient_clipping: must be a number, not a bool" in error_of(
        {"gradient_clipping": True}
    )


def test_steps_per_print_and_log_level() -> None:
    assert "steps_per_print: must be > 0, got 0" in error_of({"steps_per_print": 0})
    msg = error_of({"log_level": "verbose"})
    assert "log_level: input should be 'debug', 'info', 'warning', 'error' or 'critical'" in msg
    assert load_config({"log_level": "debug"}, 1).log_level == "debug"


# ---------------------------------------------------------------------------------------------
# precision


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("loss_scale", -1, "fp16.loss_scale: must be >= 0, got -1.0"),
        ("loss_scale", math.inf, "fp16.loss_scale: must be finite, got inf"),
        ("loss_scale", True, "fp16.loss_scale: must be a number, not a bool"),
        ("initial_scale_power", 0, "fp16.initial_scale_power: must be >= 1, got 0"),
        ("initial_scale_power", 40, "fp16.initial_scale_power: must be <= 32, got 40"),
        ("initial_scale_power", 16.5, "fp16.initial_scale_power: must be an integer, got 16.5"),
        ("loss_scale_window", 0, "fp16.loss_scale_window: must be > 0, got 0"),
        ("loss_scale_window", True, "fp16.loss_scale_window: must be an integer, not a bool"),
        ("hysteresis", 0, "fp16.hysteresis: must be >= 1, got 0"),
        ("min_loss_scale", 0, "fp16.min_loss_scale: must be > 0, got 0.0"),
        ("min_loss_scale", math.nan, "fp16.min_loss_scale: must be finite, got nan"),
        ("enabled", 1, "fp16.enabled: input should be a valid boolean (got 1)"),
    ],
)
def test_fp16_values_are_validated(field: str, value: Any, message: str) -> None:
    assert message in error_of({"fp16": {"enabled": True, field: value}})


def test_fp16_dynamic_scaling_settings_are_kept() -> None:
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 1}
    cfg = load_config({"fp16": fp16, "zero_optimization": {"stage": 2}}, 1)
    assert cfg.precision == "fp16"
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window) == (8, 50)
    assert cfg.fp16.hysteresis == 1


def test_fp16_and_bf16_together_is_an_error() -> None:
    msg = error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in msg


def test_bf16_and_its_deepspeed_alias() -> None:
    cfg = load_config({"bf16": {"enabled": True, "check_grad_overflow": False}}, 1)
    assert cfg.precision == "bf16" and cfg.bf16.check_grad_overflow is False
    assert load_config({"bfloat16": {"enabled": True}}, 1).precision == "bf16"
    assert "give only one of them" in error_of({"bfloat16": {}, "bf16": {}})


# ---------------------------------------------------------------------------------------------
# zero_optimization


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stage", 4, "zero_optimization.stage: must be <= 3, got 4"),
        ("stage", -1, "zero_optimization.stage: must be >= 0, got -1"),
        ("reduce_bucket_size", 0, "zero_optimization.reduce_bucket_size: must be > 0, got 0"),
        ("allgather_bucket_size", 1.5, "zero_optimization.allgather_bucket_size: must be an"),
        ("overlap_comm", "yes", "zero_optimization.overlap_comm: input should be a valid"),
        ("stage3_prefetch_bucket_size", -1, "stage3_prefetch_bucket_size: must be > 0, got -1"),
        ("stage3_param_persistence_threshold", -1, "threshold: must be >= 0, got -1"),
        ("stage3_max_live_parameters", 0, "stage3_max_live_parameters: must be > 0, got 0"),
    ],
)
def test_zero_values_are_validated(field: str, value: Any, message: str) -> None:
    assert message in error_of({"zero_optimization": {field: value}})


def test_zero_section_must_be_an_object() -> None:
    # true/false and an integer are DeepSpeed's legacy forms (tests/zero/test_compat_configs.py).
    assert "zero_optimization: must be an object, got str 'yes'" in error_of(
        {"zero_optimization": "yes"}
    )


# ---------------------------------------------------------------------------------------------
# unknown, ignored and unsupported keys


def test_unknown_keys_name_the_dotted_path_and_a_close_match() -> None:
    msg = error_of({"zero_optimization": {"stgae": 2}})
    assert (
        "zero_optimization.stgae: unknown key in 'zero_optimization'; "
        "did you mean 'zero_optimization.stage'?" in msg
    )
    msg = error_of({"gradient_acumulation_steps": 2})
    assert "did you mean 'gradient_accumulation_steps'?" in msg
    msg = error_of({"fp16": {"initial_scale_pwr": 8}})
    assert "fp16.initial_scale_pwr: unknown key in 'fp16'; did you mean" in msg
    assert "'fp16.initial_scale_power'" in msg
    assert "xyzzy: unknown key at the top level" in error_of({"xyzzy": 1})


def test_every_error_is_reported_at_once() -> None:
    msg = error_of({"steps_per_print": 0, "zero_optimization": {"stage": 9}, "nope": 1})
    assert msg.count("\n  - ") == 3


def test_performance_knobs_are_accepted_with_one_warning() -> None:
    config = {
        "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 2,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "round_robin_gradients": False,
            "offload_param": {"device": "none"},
        },
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, 1)
    assert cfg.zero_optimization.stage == 2
    ours = [w for w in caught if "ds_core ignores" in str(w.message)]
    assert len(ours) == 1
    text = str(ours[0].message)
    for key in (
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter",
        "zero_optimization.round_robin_gradients",
    ):
        assert key in text


# ---------------------------------------------------------------------------------------------
# DeepSpeed keys accepted with DeepSpeed's meaning (issue 26 §6)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_offload_below_stage_3_is_ignored_as_deepspeed_does(stage: int) -> None:
    # DeepSpeed 0.19.8 type-checks offload_param at every stage and hands it only to its
    # stage-3 optimizer (runtime/engine.py, _configure_zero_optimizer); stages 0-2 keep every
    # parameter whole on each rank whatever it says.
    zero = {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}}
    pattern = rf"zero_optimization\.offload_param \(device 'cpu': .* stage {stage} keeps"
    with pytest.warns(UserWarning, match=pattern):
        cfg = load_config({"zero_optimization": zero}, 1)
    assert cfg.zero_optimization.stage == stage
    assert cfg.zero_optimization.offload_param.device == "cpu"  # as given; read at stage 3 only
    nvme = {"stage": stage, "offload_param": {"device": "nvme"}}  # no folder: never used here
    with pytest.warns(UserWarning, match=r"offload_param \(device 'nvme'"):
        load_config({"zero_optimization": nvme}, 1)
    for legacy in ("cpu_offload_param", "cpu_offload_params"):
        with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param"):
            load_config({"zero_optimization": {"stage": stage, legacy: True}}, 1)
    bad = {"stage": stage, "offload_param": {"device": "disk"}}
    assert "zero_optimization.offload_param.device: input should be" in error_of(
        {"zero_optimization": bad}
    )


def test_param_offload_at_stage_3_is_used_and_checked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # used, so not named as ignored
        cfg = load_config({"zero_optimization": {"stage": 3, "cpu_offload_param": True}}, 1)
    assert cfg.zero_optimization.offload_param.device == "cpu"
    nvme = {"stage": 3, "offload_param": {"device": "nvme"}}
    assert "offload_param: device='nvme' needs nvme_path" in error_of({"zero_optimization": nvme})
    legacy = {"stage": 3, "cpu_offload_param": "yes"}
    assert "cpu_offload_param must be true or false" in error_of({"zero_optimization": legacy})


@pytest.mark.parametrize(
    ("section", "key", "feature"),
    [("fp16", "fp16_master_weights_and_grads", "fp16 master weights and fp16 gradients")],
)
def test_low_precision_masters_false_loads_and_true_names_the_missing_feature(
    section: str, key: str, feature: str
) -> None:
    with pytest.warns(UserWarning, match=rf"{section}\.{key}"):
        load_config({section: {"enabled": True, key: False}, "zero_optimization": {"stage": 2}}, 1)
    msg = error_of({section: {"enabled": True, key: True}, "zero_optimization": {"stage": 2}})
    line = next(ln for ln in msg.splitlines() if f"{section}.{key}" in ln)
    assert f"{section}.{key}: true asks for {feature}" in line, msg
    assert "not supported yet" in line and "set it to false or remove it" in line, msg
    assert f"{section}.{key}" in error_of({section: {key: "yes"}})  # not silently taken as off


_BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True}
_BF16_STATES = {**_BF16_MASTERS, "bf16_optimizer_states": True}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_states_load_where_deepspeed_takes_them(stage: int) -> None:
    # DeepSpeed 0.19.8: stages 1-3 (runtime/config.py); on the device the optimizer state must
    # be bf16 too (runtime/base_optimizer.py _configure_master_weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"bf16": _BF16_STATES, "zero_optimization": {"stage": stage}}, 2)
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
    default = load_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}, 2)
    assert not default.bf16.bf16_master_weights_and_grads
    assert not default.bf16.bf16_optimizer_states


@pytest.mark.parametrize(
    ("config", "key", "why"),
    [
        # DeepSpeed refuses these
        (
            {"bf16": _BF16_STATES, "zero_optimization": {"stage": 0}},
            "bf16.bf16_master_weights_and_grads",
            "needs ZeRO stage 1, 2 or 3, got stage 0",
        ),
        (
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "bf16.bf16_optimizer_states",
            "needs bf16.bf16_master_weights_and_grads: true",
        ),
        (
            {"bf16": _BF16_MASTERS, "zero_optimization": {"stage": 2}},
            "bf16.bf16_master_weights_and_grads",
            "without bf16.bf16_optimizer_states",
        ),
        # DeepSpeed takes these; ds_core cannot yet
        (
            {
                "bf16": _BF16_STATES,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            },
            "bf16.bf16_master_weights_and_grads",
            "with zero_optimization.offload_optimizer (device 'cpu') is not supported yet",
        ),
        (
            {
                "bf16": _BF16_MASTERS,
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            },
            "bf16.bf16_master_weights_and_grads",
            "is not supported yet",
        ),
        (
            {"bf16": {**_BF16_STATES, "enabled": False}, "zero_optimization": {"stage": 2}},
            "bf16.bf16_master_weights_and_grads",
            "needs bf16.enabled: true",
        ),
    ],
    ids=["stage0", "states-alone", "masters-alone", "offload", "offload-masters", "no-bf16"],
)
def test_bf16_master_states_refused_naming_the_key(config: dict, key: str, why: str) -> None:
    msg = error_of(config)
    assert f"{key}: true" in msg and why in msg, msg


def test_deepspeed_defaults_of_unimplemented_keys_load() -> None:
    config = {
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": False,
            "zero_quantized_nontrainable_weights": False,
            "zero_quantized_gradients": False,
            "zero_hpz_partition_size": 1,
        },
        "tensor_parallel": {"keep_module_on_host": False, "replace_with_kernel_inject": False},
    }
    with pytest.warns(UserWarning, match="zero_optimization.zero_quantized_nontrainable_weights"):
        cfg = load_config(config, 1)
    # ZeRO++'s keys are fields now (off here); the nontrainable-weights one is not built yet
    assert not cfg.zero_optimization.zero_quantized_weights
    on = {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}
    assert "zero_optimization.zero_quantized_nontrainable_weights: not supported yet" in error_of(
        on
    )


def test_deepspeed_0_19_knobs_load_and_its_features_are_refused_by_name() -> None:
    # keys of DeepSpeed 0.19.8's config that earlier ds_core refused as unknown
    knobs = {
        "disable_python_gc": True,
        "vocabulary_size": 50257,
        "zero_optimization": {
            "stage": 3,
            "stage3_model_persistence_threshold": 10**6,
            "stage3_allgather_sequential": True,
            "parameter_alignment": True,
            "leaf_module": {"classes": ["MoEBlock"]},
            "cpu_offload_use_pin_memory": True,
            "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5},
        },
        "expert_parallel": {"combine_impl": "fused_weighted_sum", "comm_num_sm": 20},
    }
    with pytest.warns(UserWarning) as record:
        cfg = load_config(knobs, 1)
    text = str(record[0].message)
    for key in ("disable_python_gc",
                "zero_optimization.offload_optimizer.cpuadam_cores_perc",
                "expert_parallel.comm_num_sm"):  # fmt: skip
        assert key in text, text
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    for config, key in [
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
        ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "zenflow"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"super_offload": True}}},
            "zero_optimization.offload_optimizer.super_offload",
        ),
        ({"tensor_parallel": {"vocab_parallel_lm_head": True}}, "vocab_parallel_lm_head"),
        ({"expert_parallel": {"comm_backend": "deepep"}}, "expert_parallel.comm_backend"),
        ({"data_types": {"param_dtype": "fp32"}}, "data_types"),
    ]:
        assert f"{key}: not supported yet" in error_of(config), key


def test_no_warning_without_ignored_keys() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"zero_optimization": {"stage": 1}}, 1)


@pytest.mark.parametrize(
    ("config", "path"),
    [
        (
            {"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
            "zero_optimization.zero_quantized_nontrainable_weights",
        ),
        ({"compression_training": {"weight_quantization": {}}}, "compression_training"),
        ({"amp": {"enabled": True}}, "amp"),
        ({"fp16": {"consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis"),
    ],
)
def test_result_changing_keys_are_not_supported_yet(config: dict[str, Any], path: str) -> None:
    msg = error_of(config)
    assert f"{path}: not supported yet" in msg


def test_gradient_reduction_keys_are_typed() -> None:
    cfg = load_config(
        {
            "communication_data_type": "bf16",
            "prescale_gradients": True,
            "gradient_predivide_factor": 2.0,
        },
        1,
    )
    assert (cfg.communication_data_type, cfg.prescale_gradients) == ("bf16", True)
    assert cfg.gradient_predivide_factor == 2.0
    assert "communication_data_type" in error_of({"communication_data_type": "int8"})
    assert "gradient_predivide_factor" in error_of({"gradient_predivide_factor": 0})


# ---------------------------------------------------------------------------------------------
# files


def test_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}}))
    cfg = load_config(path, 2)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage) == (4, 1)
    assert load_config(str(path), 2) == cfg


def test_missing_file_and_bad_json_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    assert f"config file '{missing}' does not exist" in error_of(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    msg = error_of(bad)
    assert f"config file '{bad}' is not valid JSON" in msg and "line 1" in msg
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert "must hold a JSON object, got list" in error_of(listed)


def test_config_of_another_type_is_an_error() -> None:
    assert "config must be a dict, a path to a JSON file or None, got int" in error_of(3)


def test_dsconfig_rejects_unknown_fields_when_built_directly() -> None:
    with pytest.raises(ValueError, match="extra"):
        DSConfig(
            train_batch_size=1,
            train_micro_batch_size_per_gpu=1,
            gradient_accumulation_steps=1,
            bogus=1,  # type: ignore[call-arg]
        )


def test_sequence_parallel_ranks_read_one_batch() -> None:
    # DeepSpeed's runtime/config.py divides the world by sequence_parallel_size (and AutoTP's).
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}, 8)
    assert cfg.train_batch_size == 2 * 4 and cfg.sequence_parallel_size == 2
    both = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": 2,
        "tensor_parallel": {"autotp_size": 2},
    }
    assert load_config(both, 8).train_batch_size == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size: 3 does not divide the 8 ranks"):
        load_config({"sequence_parallel_size": 3}, 8)
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        load_config({"sequence_parallel_size": 0}, 8)

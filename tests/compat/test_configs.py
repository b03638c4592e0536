"""A corpus of DeepSpeed-style configs (written for these tests, covering the keys issue 15
names): each loads, or is refused with a message naming the key and the reason."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_core import ConfigError
from ds_core.zero.adam import AdamNoBiasCorrection
from ds_core.zero.compat.builders import build_optimizer, build_scheduler
from ds_core.zero.config import load_config

CONFIGS = Path(__file__).parent / "configs"
MB = {"train_micro_batch_size_per_gpu": 2}

#: (name, config) pairs DeepSpeed accepts and ds_core must load.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("amp off", {"amp": {"enabled": False, "opt_level": "O1"}}),
    ("torch_autocast off", {"torch_autocast": {"enabled": False}}),
    ("hybrid_engine off", {"hybrid_engine": {"enabled": False, "max_out_tokens": 512}}),
    ("compile nothing on", {"compile": {"deepcompile": False, "offload_activation": False}}),
    ("data_types fp32 accumulation", {"data_types": {"grad_accum_dtype": "fp32"}}),
    ("zero true (legacy: stage 1)", {"zero_optimization": True}),
    ("zero integer (legacy: the stage)", {"zero_optimization": 2}),
    ("zero false", {"zero_optimization": False}),
    (
        "legacy gather_16bit name",
        {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}},
    ),
    ("cuda_visible_devices", {"cuda_visible_devices": "0,1"}),
    ("dataloader_drop_last", {"dataloader_drop_last": True}),
    ("bfloat16 alias", {"bfloat16": {"enabled": True}}),
    (
        "bf16 variants off",
        {
            "bf16": {
                "enabled": True,
                "immediate_grad_update": False,
                "bf16_master_weights_and_grads": False,
                "bf16_optimizer_states": False,
            }
        },
    ),
    ("fp16 auto_cast off", {"fp16": {"enabled": True, "auto_cast": False}}),
    ("fp16 auto_cast on", {"fp16": {"enabled": True, "auto_cast": True}}),
    (
        "torch_autocast on",
        {
            "torch_autocast": {
                "enabled": True,
                "dtype": "bfloat16",
                "lower_precision_safe_modules": ["torch.nn.Linear"],
            }
        },
    ),
    (
        "Lamb as BERT pre-training sets it",
        {
            "optimizer": {
                "type": "Lamb",
                "params": {
                    "lr": 11e-3,
                    "weight_decay": 0.01,
                    "bias_correction": False,
                    "max_coeff": 0.3,
                    "min_coeff": 0.01,
                },
            }
        },
    ),
    (
        "OneBitAdam with its transport keys",
        {
            "optimizer": {
                "type": "OneBitAdam",
                "params": {
                    "lr": 4e-4,
                    "freeze_step": 23000,
                    "cuda_aware": False,
                    "comm_backend_name": "nccl",
                },
            },
            "fp16": {"enabled": True},
        },
    ),
    (
        "bias_correction false",
        {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False}}},
    ),
    (
        "LRRangeTest",
        {
            "scheduler": {
                "type": "LRRangeTest",
                "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10},
            }
        },
    ),
    (
        "activation_checkpointing",
        {
            "activation_checkpointing": {
                "partition_activations": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 4,
                "cpu_checkpointing": True,
                "synchronize_checkpoint_boundary": False,
                "profile": False,
            }
        },
    ),
    ("offload none", {"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}}),
    (
        "optimizer offload (issue 12)",
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    ),
]

#: (name, config, the key named, the reason) DeepSpeed accepts and ds_core refuses.
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("amp on", {"amp": {"enabled": True}}, "amp", "not supported yet"),
    (
        "autocast with bf16",
        {"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}},
        "torch_autocast.enabled with fp16/bf16",
        "enable one",
    ),
    (
        "auto_cast without fp16",
        {"fp16": {"auto_cast": True}},
        "fp16.auto_cast needs fp16.enabled",
        "true",
    ),
    (
        "autocast dtype",
        {"torch_autocast": {"enabled": True, "dtype": "int8"}},
        "torch_autocast.dtype",
        "must be one of",
    ),
    (
        "hybrid_engine on",
        {"hybrid_engine": {"enabled": True}},
        "hybrid_engine",
        "not supported yet",
    ),
    ("compile on", {"compile": {"deepcompile": True}}, "compile", "not supported yet"),
    (
        "bf16 accumulation",
        {"data_types": {"grad_accum_dtype": "bf16"}},
        "data_types",
        "not supported yet",
    ),
    (
        "NVMe parameter offload without its folder",
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        "zero_optimization.offload_param",
        "needs nvme_path",
    ),
    (
        "OneCycle",
        {"scheduler": {"type": "OneCycle", "params": {}}},
        "scheduler.type",
        "not supported yet",
    ),
    ("Lion", {"optimizer": {"type": "Lion", "params": {}}}, "optimizer.type", "not supported yet"),
    (
        "Lamb under ZeRO",
        {"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}},
        "optimizer.type 'Lamb' needs zero_optimization.stage 0",
        "trust ratio",
    ),
    (
        "OneBitAdam under ZeRO",
        {"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 2}},
        "optimizer.type 'OneBitAdam' needs zero_optimization.stage 0",
        "not compatible with ZeRO",
    ),
    (
        "Lamb with max_grad_norm",
        {"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}},
        "max_grad_norm",
        "gradient_clipping",
    ),
    (
        "amsgrad",
        {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
        "optimizer.params",
        "amsgrad",
    ),
    (
        "bf16 master weights offloaded",
        {
            "bf16": {
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            },
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        "bf16.bf16_master_weights_and_grads",
        "not supported yet",
    ),
    (
        "checkpointing rule",
        {"activation_checkpointing": {"profile": 1}},
        "activation_checkpointing.profile",
        "bool",
    ),
]


@pytest.mark.parametrize(("name", "config"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted(name: str, config: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the knobs' once-only notice
        load_config({**MB, **config}, 2)


@pytest.mark.parametrize(("name", "config", "key", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_the_named_reason(
    name: str, config: dict[str, Any], key: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**MB, **config}, 2)
    msg = str(info.value)
    line = next((ln for ln in msg.splitlines() if key in ln), msg)
    assert key in line and reason in line, msg


def test_legacy_zero_forms_mean_what_deepspeed_reads() -> None:
    assert load_config({"zero_optimization": True}, 1).zero_optimization.stage == 1
    assert load_config({"zero_optimization": False}, 1).zero_optimization.stage == 0
    assert load_config({"zero_optimization": 3}, 1).zero_optimization.stage == 3


def test_knobs_are_named_in_one_notice() -> None:
    with pytest.warns(UserWarning) as record:
        load_config({"cuda_visible_devices": "0", "amp": {"enabled": False}}, 1)
    assert len(record) == 1
    assert "cuda_visible_devices" in str(record[0].message) and "amp" in str(record[0].message)


def test_each_problem_once_under_one_header() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "train_batch_size": "x",
                "train_micro_batch_size_per_gpu": 0,
                "amp": {"enabled": True},
                "zero_optimization": {"stgae": 1},
            },
            2,
        )
    msg = str(info.value)
    assert msg.count("invalid ds_core config") == 1, msg
    lines = msg.splitlines()[1:]
    assert len(lines) == len(set(lines)) == 4, msg


def test_corpus_files() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cifar = load_config(CONFIGS / "cifar10_ds_config.json", 2)
        assert (cifar.train_micro_batch_size_per_gpu, cifar.gradient_accumulation_steps) == (8, 1)
        gan = load_config(CONFIGS / "gan_deepspeed_config.json", 1)
        assert gan.gradient_clipping == 1.0  # DeepSpeed 0.19.8: GRADIENT_CLIPPING_DEFAULT = 1.0
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "megatron_style_refused.json", 2)
    msg = str(info.value)
    assert "compression_training: not supported yet" in msg, msg
    assert "offload_param: device='nvme' needs nvme_path" in msg, msg
    # implemented: ds_core.checkpointing, the engine's input cast
    assert "activation_checkpointing" not in msg and "auto_cast" not in msg


@pytest.mark.skipif(importlib.util.find_spec("hjson") is None, reason="hjson not installed")
def test_hjson_file_loads_as_deepspeed_reads_it() -> None:
    cfg = load_config(CONFIGS / "bert_hjson_config.hjson", 2)
    assert cfg.gradient_accumulation_steps == 2 and cfg.zero_optimization.stage == 1
    assert cfg.optimizer is not None and cfg.optimizer.params["bias_correction"] is False


def test_hjson_without_the_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_hjson(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "hjson":
            raise ImportError("no hjson")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hjson)
    with pytest.raises(ConfigError, match=r"pip install 'ds-core\[hjson\]'"):
        load_config(CONFIGS / "bert_hjson_config.hjson", 2)


def test_adam_without_bias_correction_follows_fusedadams_formula() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    cfg = load_config(
        {
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 0.1, "weight_decay": 0.01, "bias_correction": False},
            }
        },
        1,
    )
    assert cfg.optimizer is not None
    opt = build_optimizer(cfg.optimizer, [p])
    assert isinstance(opt, AdamNoBiasCorrection)
    ref = p.detach().clone()
    m, v = torch.zeros(5), torch.zeros(5)
    for step in range(3):
        g = torch.full((5,), 0.5 + step)
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        ref = ref * (1 - 0.1 * 0.01) - 0.1 * m / (v.sqrt() + 1e-8)
    torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-6)


def test_lr_range_test_schedule() -> None:
    cfg = load_config(
        {
            "scheduler": {
                "type": "LRRangeTest",
                "params": {
                    "lr_range_test_min_lr": 0.01,
                    "lr_range_test_step_size": 2,
                    "lr_range_test_staircase": True,
                },
            }
        },
        1,
    )
    assert cfg.scheduler is not None
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(cfg.scheduler, opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(4):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    # DeepSpeed: min_lr * (1 + rate * floor((it + 1) / step_size))
    assert lrs == pytest.approx([0.01, 0.01, 0.02, 0.02, 0.03])


def test_scheduler_names_import_from_deepspeeds_module_path() -> None:
    from ds_core.runtime.lr_schedules import (
        LRRangeTest,
        OneCycle,
        WarmupCosineLR,
        WarmupDecayLR,
        WarmupLR,
    )

    schedules = (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR)
    assert all(isinstance(c, type) for c in schedules)

"""ds_core's config defaults held against DeepSpeed 0.19.8's, one row per key.

Each row names the key, DeepSpeed 0.19.8's default and the DeepSpeed file and symbol it is
read from (paths below ``deepspeed/`` of the 0.19.8 source distribution); a row whose ds_core
value or meaning differs says so and why (docs/from-deepspeed.md, "DeepSpeed's defaults",
prints the same table). The table covers every field of the schema: a new
field without a row fails ``test_every_field_has_a_row``. Rows for DeepSpeed keys
that are not fields here check that a config giving DeepSpeed's default loads.
"""

from __future__ import annotations

import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ds_core import ConfigError
from ds_core.zero.config import DSConfig, load_config
from ds_core.zero.config.optimizer import OPTIMIZER_TYPES, SCHEDULER_TYPES, AdamParams

DOC = Path(__file__).resolve().parents[2] / "docs" / "from-deepspeed.md"


class _Mark:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


SAME = _Mark("same")
"""ds_core's default is DeepSpeed's."""
REFUSED = _Mark("refused")
"""The config is refused (DeepSpeed: an assertion; ds_core: a ConfigError)."""
REQUIRED = _Mark("required")
"""No default: the key must be given."""
ABSENT = _Mark("no such key")
"""DeepSpeed has no such key (a ds_core key)."""
ACCEPTED = _Mark("accepted, not a field")
"""Not a ds_core field: a config giving DeepSpeed's default loads (ignored, or a no-op)."""
UNSET = _Mark("unset: the preset's")
"""DeepSpeed's ``_UNSET``: the preset decides."""


@dataclass(frozen=True)
class Row:
    key: str
    """Dotted path in the config (list items by index)."""
    deepspeed: Any
    """DeepSpeed 0.19.8's default, as JSON would hold it."""
    source: str
    """``file:symbol`` below ``deepspeed/`` of DeepSpeed 0.19.8 where the default is set."""
    ds_core: Any = SAME
    reason: str = ""
    """Set exactly when ds_core's value or the meaning of the default differs."""
    given: dict[str, Any] = field(default_factory=dict)
    """The rest of the config the row is read under (a section's required keys, the stage)."""
    scope: str = ""
    """Which variant of a section (the scheduler type) the key belongs to."""
    note: str = ""
    """The condition under which the default holds, for the docs table."""

    @property
    def expected(self) -> Any:
        return self.deepspeed if self.ds_core is SAME else self.ds_core

    @property
    def ident(self) -> str:
        return f"{self.key}[{self.scope}]" if self.scope else self.key


CONST = "runtime/constants.py"
FP16 = "runtime/precision_config.py:DeepSpeedFP16Config"
BF16 = "runtime/precision_config.py:DeepSpeedBF16Config"
ZERO = "runtime/zero/config.py:DeepSpeedZeroConfig"
OFF_OPT = "runtime/zero/offload_config.py:DeepSpeedZeroOffloadOptimizerConfig"
OFF_PARAM = "runtime/zero/offload_config.py:DeepSpeedZeroOffloadParamConfig"
AIO = "runtime/swap_tensor/constants.py"
ACT = "runtime/activation_checkpointing/config.py"
TP = "runtime/tensor_parallel/config.py:TPTrainingConfig"
PIPE = "runtime/config.py:get_pipeline_config"
AUTOTP = "module_inject/autotp_config.py:AutoTPConfig.from_dict"
EP = "module_inject/auto_ep_config.py:parse_autoep_config"
ADAM = "ops/adam/fused_adam.py:FusedAdam.__init__"
LRS = "runtime/lr_schedules.py"
BATCH = "runtime/config.py:DeepSpeedConfig._set_batch_related_parameters"

MB2 = {"train_micro_batch_size_per_gpu": 2}
S3 = {"zero_optimization": {"stage": 3}}
PART = {"tensor_parallel": {"partition_config": {}}}
SPEC = {"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"]}]}}}
OPT = {"optimizer": {"type": "Adam"}}
FP32_REDUCE = (
    "same value, other meaning: ds_core reduces gradients in fp32 whatever the model's dtype "
    "(docs/architecture.md §3.2: 16-bit gradients accumulate and reduce in fp32 unless "
    "configured otherwise); "
    "DeepSpeed reduces in the model's dtype"
)
OWN = "ds_core's own key"


def _sched(kind: str, **given: Any) -> dict[str, Any]:
    return {"scheduler": {"type": kind, "params": given}}


ROWS: list[Row] = [
    # ---- batch sizes and top level
    Row("train_micro_batch_size_per_gpu", REFUSED, BATCH, 1,
        "a config that sets no batch size means micro-batch 1 (DeepSpeed asserts 'Either "
        "train_batch_size or train_micro_batch_size_per_gpu needs to be provided'); no config "
        "DeepSpeed accepts reads differently", note="no batch size given"),
    Row("train_micro_batch_size_per_gpu", 4, BATCH, given={"train_batch_size": 4}, scope="tb",
        note="train_batch_size 4 alone, 1 rank: train_batch_size / world"),
    Row("train_batch_size", 2, BATCH, given=MB2,
        note="micro-batch 2 alone, 1 rank: micro × accumulation × world"),
    Row("gradient_accumulation_steps", 1, BATCH, given=MB2, note="not derivable: 1"),
    Row("gradient_clipping", 1.0, f"{CONST}:GRADIENT_CLIPPING_DEFAULT"),
    Row("steps_per_print", None, f"{CONST}:STEPS_PER_PRINT_DEFAULT", note="no progress line"),
    Row("log_level", None, f"{CONST}:LOG_LEVEL_DEFAULT", note="logger level left alone"),
    Row("communication_data_type", None, f"{CONST}:COMMUNICATION_DATA_TYPE_DEFAULT",
        reason=FP32_REDUCE),
    Row("prescale_gradients", False, f"{CONST}:PRESCALE_GRADIENTS_DEFAULT"),
    Row("gradient_predivide_factor", 1.0, f"{CONST}:GRADIENT_PREDIVIDE_FACTOR_DEFAULT"),
    Row("dataloader_drop_last", False, f"{CONST}:DATALOADER_DROP_LAST_DEFAULT"),
    Row("optimizer", None, f"{CONST}:OPTIMIZER_TYPE_DEFAULT"),
    Row("scheduler", None, f"{CONST}:SCHEDULER_TYPE_DEFAULT"),
    Row("accelerator", ABSENT, "-", {},
        f"{OWN}: per-backend options for get_accelerator().configure()"),
    Row("deterministic.enabled", ABSENT, "-", False,
        f"{OWN} (docs/determinism.md); off, as DeepSpeed runs"),
    Row("deterministic.seed", ABSENT, "-", 0, f"{OWN}: the seed when deterministic is on"),
    Row("nonfinite_gradients.skip", ABSENT, "-", True,
        f"{OWN}: fp32 and bf16 steps with an inf/NaN gradient norm are skipped as fp16's are; "
        "DeepSpeed applies them in fp32 (docs/from-deepspeed.md, Different on purpose)"),
    Row("nonfinite_gradients.max_consecutive_skips", ABSENT, "-", 20,
        f"{OWN}: stop after this many skipped steps in a row instead of training on"),
    Row("gradient_allreduce_op", "mean", f"{CONST}:GRADIENT_ALLREDUCE_OP_DEFAULT", ACCEPTED),
    Row("data_types.grad_accum_dtype", None, f"{CONST}:GRAD_ACCUM_DTYPE_DEFAULT", ACCEPTED),
    Row("data_types.param_dtype", None, f"{CONST}:PARAM_DTYPE_DEFAULT", ACCEPTED),
    Row("data_types.buffer_dtype", None, f"{CONST}:BUFFER_DTYPE_DEFAULT", ACCEPTED),
    Row("managed_gradient_accumulation", True,
        f"{CONST}:MANAGED_GRADIENT_ACCUMULATION_DEFAULT", ACCEPTED, note="false is refused"),
    Row("use_data_before_expert_parallelism", False,
        f"{CONST}:USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT", ACCEPTED),
    # ---- fp16 / bf16
    Row("fp16.enabled", False, f"{FP16}.enabled"),
    Row("fp16.loss_scale", 0.0, f"{FP16}.loss_scale", note="0: dynamic"),
    Row("fp16.initial_scale_power", 16, f"{FP16}.initial_scale_power"),
    Row("fp16.loss_scale_window", 1000, f"{FP16}.loss_scale_window"),
    Row("fp16.hysteresis", 2, f"{FP16}.hysteresis"),
    Row("fp16.min_loss_scale", 1, f"{FP16}.min_loss_scale"),
    Row("fp16.auto_cast", False, f"{FP16}.auto_cast"),
    Row("fp16.consecutive_hysteresis", False, f"{FP16}.consecutive_hysteresis", ACCEPTED),
    Row("fp16.fp16_master_weights_and_grads", False, f"{FP16}.fp16_master_weights_and_grads",
        ACCEPTED, note="true is refused: fp16 masters not supported yet"),
    Row("bf16.enabled", False, f"{BF16}.enabled"),
    Row("bf16.check_grad_overflow", True, f"{BF16}.check_grad_overflow",
        note="constants.py's BFLOAT16_CHECK_OVERFLOW_DEFAULT = False is not read"),
    Row("bf16.immediate_grad_update", False, f"{BF16}.immediate_grad_update", ACCEPTED,
        note="ignored: both modes add each micro-batch's bf16 gradient into fp32"),
    Row("bf16.bf16_master_weights_and_grads", False, f"{BF16}.bf16_master_weights_and_grads",
        note="true: stages 1-3, with bf16_optimizer_states; not with offload_optimizer yet"),
    Row("bf16.bf16_optimizer_states", False, f"{BF16}.bf16_optimizer_states",
        note="true needs bf16_master_weights_and_grads"),
    # ---- zero_optimization
    Row("zero_optimization.stage", 0, f"{ZERO}.stage"),
    Row("zero_optimization.reduce_bucket_size", 500_000_000, f"{ZERO}.reduce_bucket_size",
        5_000_000, "a bucket is a unit whose fp32 staging buffer backward holds: at 5e8 a model "
        "under 5e8 parameters is one bucket, stages 1/2 stage a whole gradient and reduce only "
        "after backward (no overlap). Measured on sim, 16 × Linear(1024, 1024), 2 ranks: stage 2 "
        "peak / ZeRO formula 1.43 at 5e8, 1.20 at 5e6 (bench/memory_formula.py)"),
    Row("zero_optimization.allgather_bucket_size", 500_000_000,
        f"{ZERO}.allgather_bucket_size"),
    Row("zero_optimization.overlap_comm", False, f"{ZERO}.overlap_comm_valid",
        note="stages 0-2"),
    Row("zero_optimization.overlap_comm", True, f"{ZERO}.overlap_comm_valid", given=S3,
        scope="stage 3", note="stage 3"),
    Row("zero_optimization.stage3_prefetch_bucket_size", 50_000_000,
        f"{ZERO}.prefetch_bucket_size", None, "unset: a quarter of each rank's partitioned "
        "elements (Ψ/4N), at most 5e6 (ds_core/zero/stage3.py, default_prefetch_numel); a set "
        "value is used as given. The elements prefetched ahead of use are gathered parameters on "
        "top of stage 3's 16Ψ/N bytes, so Ψ/4N costs at most 1/16 of it on any model; a fixed "
        "bucket is the whole model ahead on a small one. Measured on sim, 2 ranks, stage 3 peak "
        "/ ZeRO formula (bench/memory_formula.py): GPT large 1.59 at 5e7, 1.26 at 5e6 and at the "
        "rule (the optimizer step's peak); 16 × Linear(1024, 1024) 1.60 / 1.25 / 1.25; GPT small "
        "(3.2 M) 1.82 at 5e7 and at 5e6, 1.51 at the rule"),
    Row("zero_optimization.stage3_param_persistence_threshold", 100_000,
        f"{ZERO}.param_persistence_threshold"),
    Row("zero_optimization.stage3_max_live_parameters", 1_000_000_000,
        f"{ZERO}.max_live_parameters"),
    Row("zero_optimization.stage3_max_reuse_distance", 1_000_000_000,
        f"{ZERO}.max_reuse_distance",
        reason="same value, other meaning: ds_core's trace is the forward's, so a unit is kept "
        "for a reuse later in the forward but released and gathered again for backward; "
        "DeepSpeed's trace also records the modules backward runs "
        "(runtime/zero/parameter_offload.py, pre_sub_module_backward_function), so at 1e9 a "
        "model under 1e9 elements stays gathered from its forward to its backward: one "
        "all-gather per unit per step fewer, and every parameter whole during backward (4Ψ on "
        "top of stage 3's 16Ψ/N; the default peak measures 1.28 of the formula on sim, "
        "bench/memory_formula.py)"),
    Row("zero_optimization.leaf_module.classes", [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
        "runtime/zero/leaf_module_config.py:DEFAULT_LEAF_MODULE_CLASSES", [],
        "ds_core names no class by default: its stage 3 does not special-case transformers' "
        "MoE blocks, and an entry matching no module of the model is an error at initialize",
        note="stage-3 modules gathered and released whole, one unit per leaf"),
    Row("zero_optimization.leaf_module.names", [],
        "runtime/zero/leaf_module_config.py:DEFAULT_LEAF_MODULE_NAMES"),
    Row("zero_optimization.leaf_module.name_suffixes", [],
        "runtime/zero/leaf_module_config.py:DEFAULT_LEAF_MODULE_NAME_SUFFIXES"),
    Row("zero_optimization.ignore_unused_parameters", True, f"{ZERO}.ignore_unused_parameters",
        note="false: a step with a trainable parameter that got no gradient raises, at stages "
        "1/2 with optimizer offload (where DeepSpeed asserts)"),
    Row("zero_optimization.stage3_gather_16bit_weights_on_model_save", False,
        f"{ZERO}.gather_16bit_weights_on_model_save"),
    Row("zero_optimization.sub_group_size", 1_000_000_000, f"{ZERO}.sub_group_size"),
    Row("zero_optimization.zero_hpz_partition_size", 1, f"{ZERO}.zero_hpz_partition_size",
        ACCEPTED),
    Row("zero_optimization.zero_quantized_weights", False, f"{ZERO}.zero_quantized_weights",
        ACCEPTED),
    Row("zero_optimization.zero_quantized_nontrainable_weights", False,
        f"{ZERO}.zero_quantized_nontrainable_weights", ACCEPTED),
    Row("zero_optimization.zero_quantized_gradients", False,
        f"{ZERO}.zero_quantized_gradients", ACCEPTED),
    Row("zero_optimization.pipeline_loading_checkpoint", False,
        f"{ZERO}.pipeline_loading_checkpoint", ACCEPTED),
    Row("zero_optimization.compute_grad_norm", True, f"{ZERO}.compute_grad_norm", ACCEPTED),
    Row("zero_optimization.zenflow", None, f"{ZERO}.zenflow", ACCEPTED),
    Row("zero_optimization.offload_optimizer.super_offload", False, f"{OFF_OPT}.super_offload",
        ACCEPTED, given={"zero_optimization": {"stage": 3}}),
    Row("zero_optimization.offload_optimizer.device", "none", f"{OFF_OPT}.device",
        note="section absent: no offload"),
    Row("zero_optimization.offload_optimizer.nvme_path", None, f"{OFF_OPT}.nvme_path"),
    Row("zero_optimization.offload_optimizer.buffer_count", 4, f"{OFF_OPT}.buffer_count"),
    Row("zero_optimization.offload_optimizer.pin_memory", True, f"{OFF_OPT}.pin_memory"),
    Row("zero_optimization.offload_optimizer.pipeline_read", False, f"{OFF_OPT}.pipeline_read"),
    Row("zero_optimization.offload_optimizer.pipeline_write", False,
        f"{OFF_OPT}.pipeline_write"),
    Row("zero_optimization.offload_optimizer.fast_init", False, f"{OFF_OPT}.fast_init"),
    Row("zero_optimization.offload_optimizer.ratio", 1.0, f"{OFF_OPT}.ratio"),
    Row("zero_optimization.offload_param.device", "none", f"{OFF_PARAM}.device",
        note="read at stage 3 only"),
    Row("zero_optimization.offload_param.nvme_path", None, f"{OFF_PARAM}.nvme_path"),
    Row("zero_optimization.offload_param.buffer_count", 5, f"{OFF_PARAM}.buffer_count"),
    Row("zero_optimization.offload_param.buffer_size", 100_000_000, f"{OFF_PARAM}.buffer_size"),
    Row("zero_optimization.offload_param.max_in_cpu", 1_000_000_000, f"{OFF_PARAM}.max_in_cpu"),
    Row("zero_optimization.offload_param.pin_memory", True, f"{OFF_PARAM}.pin_memory"),
    # ---- aio
    Row("aio.block_size", 1_048_576, f"{AIO}:AIO_BLOCK_SIZE_DEFAULT"),
    Row("aio.queue_depth", 8, f"{AIO}:AIO_QUEUE_DEPTH_DEFAULT"),
    Row("aio.intra_op_parallelism", 1, f"{AIO}:AIO_INTRA_OP_PARALLELISM_DEFAULT"),
    Row("aio.single_submit", False, f"{AIO}:AIO_SINGLE_SUBMIT_DEFAULT"),
    Row("aio.overlap_events", True, f"{AIO}:AIO_OVERLAP_EVENTS_DEFAULT"),
    Row("aio.use_gds", False, f"{AIO}:AIO_USE_GDS_DEFAULT"),
    # ---- activation checkpointing
    Row("activation_checkpointing.partition_activations", False,
        f"{ACT}:ACT_CHKPT_PARTITION_ACTIVATIONS_DEFAULT"),
    Row("activation_checkpointing.contiguous_memory_optimization", False,
        f"{ACT}:ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION_DEFAULT"),
    Row("activation_checkpointing.number_checkpoints", None,
        f"{ACT}:ACT_CHKPT_NUMBER_CHECKPOINTS_DEFAULT"),
    Row("activation_checkpointing.cpu_checkpointing", False,
        f"{ACT}:ACT_CHKPT_CPU_CHECKPOINTING_DEFAULT"),
    Row("activation_checkpointing.synchronize_checkpoint_boundary", False,
        f"{ACT}:ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY_DEFAULT"),
    Row("activation_checkpointing.profile", False, f"{ACT}:ACT_CHKPT_PROFILE_DEFAULT"),
    # ---- torch_autocast
    Row("torch_autocast.enabled", False, f"{CONST}:TORCH_AUTOCAST_ENABLED_DEFAULT"),
    Row("torch_autocast.dtype", None, "runtime/config.py:get_torch_autocast_dtype",
        note="torch.autocast's default for the device: float16 on CUDA, bfloat16 on CPU"),
    Row("torch_autocast.lower_precision_safe_modules", None,
        "runtime/config.py:get_lower_precision_safe_modules",
        reason="same value, other meaning: DeepSpeed then reduces Linear/Conv gradients in the "
        "autocast dtype; ds_core reduces every gradient in communication_data_type (fp32)"),
    # ---- pipeline and sequence parallelism
    Row("pipeline.stages", "auto", f"{PIPE}", note="auto: the PipelineModule's num_stages"),
    Row("pipeline.partition", "best", f"{PIPE}"),
    Row("pipeline.seed_layers", False, f"{PIPE}"),
    Row("pipeline.activation_checkpoint_interval", 0, f"{PIPE}"),
    Row("pipeline.pipe_partitioned", True, f"{PIPE}"),
    Row("pipeline.grad_partitioned", True, f"{PIPE}"),
    Row("sequence_parallel_size", 1, "runtime/config.py:DeepSpeedConfig.__init__",
        note="absent: the world is not divided"),
    # ---- tensor_parallel (AutoTP)
    Row("tensor_parallel.autotp_size", 0, f"{TP}.autotp_size", note="0: off"),
    Row("tensor_parallel.partition_config", None, f"{TP}.partition_config"),
    Row("tensor_parallel.tp_overlap_comm", False, f"{TP}.tp_overlap_comm", ACCEPTED),
    Row("tensor_parallel.keep_module_on_host", False, f"{TP}.keep_module_on_host", ACCEPTED),
    Row("tensor_parallel.replace_with_kernel_inject", False,
        f"{TP}.replace_with_kernel_inject", ACCEPTED),
    Row("tensor_parallel.preset_model", None, f"{TP}.preset_model", ACCEPTED),
    Row("tensor_parallel.injection_policy_tuple", None, f"{TP}.injection_policy_tuple",
        ACCEPTED),
    Row("tensor_parallel.vocab_parallel_lm_head", None, f"{TP}.vocab_parallel_lm_head",
        ACCEPTED),
    Row("tensor_parallel.vocab_parallel_ce_backend", "torch", f"{TP}.vocab_parallel_ce_backend",
        ACCEPTED),
    Row("tensor_parallel.partition_config.use_default_specs", True, AUTOTP, given=PART),
    Row("tensor_parallel.partition_config.layer_specs", [], AUTOTP, given=PART),
    Row("tensor_parallel.partition_config.strict_mode", False, AUTOTP, given=PART),
    Row("tensor_parallel.partition_config.lm_head_patterns", ["lm_head", "embed_out"], AUTOTP,
        given=PART),
    Row("tensor_parallel.partition_config.embedding_partition_dim", 1, AUTOTP, given=PART),
    Row("tensor_parallel.partition_config.tp_size", 1, AUTOTP, None,
        "None follows autotp_size: DeepSpeed overwrites tp_size with autotp_size "
        "(TPTrainingConfig.get_partition_config_object), so its 1 is never used", given=PART),
    Row("tensor_parallel.partition_config.layer_specs.0.patterns", [], AUTOTP, REQUIRED,
        "a layer spec without patterns matches no layer; ds_core asks for one, as it refuses a "
        "pattern matching no module (ds_core.parallel.tensor.plan)",
        given={"tensor_parallel": {"partition_config": {"layer_specs": [{}]}}}),
    Row("tensor_parallel.partition_config.layer_specs.0.partition_type", "column", AUTOTP,
        given=SPEC),
    Row("tensor_parallel.partition_config.layer_specs.0.shape", None, AUTOTP, given=SPEC),
    Row("tensor_parallel.partition_config.layer_specs.0.partition_dim", None, AUTOTP,
        given=SPEC, note="0 for column, 1 for row"),
    Row("tensor_parallel.partition_config.layer_specs.0.model_types", None, AUTOTP, given=SPEC),
    Row("tensor_parallel.partition_config.layer_specs.0.gather_output", False, AUTOTP,
        given=SPEC),
    # ---- expert_parallel (AutoEP)
    Row("expert_parallel.enabled", False, EP),
    Row("expert_parallel.autoep_size", 1, EP),
    Row("expert_parallel.preset_model", None, EP),
    Row("expert_parallel.moe_layer_pattern", None, EP),
    Row("expert_parallel.router_pattern", None, EP),
    Row("expert_parallel.expert_pattern", None, EP),
    Row("expert_parallel.top_k", "auto", EP),
    Row("expert_parallel.top_k_attr", None, EP),
    Row("expert_parallel.num_experts_attr", None, EP),
    Row("expert_parallel.route_norm", None, EP),
    Row("expert_parallel.route_scale", 1.0, EP),
    Row("expert_parallel.routed_scaling_factor", "auto", EP),
    Row("expert_parallel.score_func", "auto", EP),
    Row("expert_parallel.score_apply", "auto", EP),
    Row("expert_parallel.num_expert_groups", None, EP),
    Row("expert_parallel.num_limited_groups", None, EP),
    Row("expert_parallel.load_balance_coeff", None, EP, note="other values refused by both"),
    Row("expert_parallel.expert_w1", None, EP),
    Row("expert_parallel.expert_w2", None, EP),
    Row("expert_parallel.expert_w3", UNSET, EP, None,
        "no value: DeepSpeed takes the preset's third weight (null there means a fused "
        "gate/up); ds_core calls each expert as it is and only checks a given name"),
    Row("expert_parallel.has_shared_experts", None, EP),
    Row("expert_parallel.shared_experts_pattern", None, EP),
    Row("expert_parallel.expert_tensor_parallel_size", 1, EP, ACCEPTED),
    Row("expert_parallel.comm_backend", "comm", EP, ACCEPTED),
    Row("expert_parallel.shared_experts_gate_pattern", None, EP, ACCEPTED),
    Row("expert_parallel.expert_activation", None, EP, ACCEPTED, note="the preset's"),
    Row("expert_parallel.capacity_factor", ABSENT, "-", None,
        f"{OWN}: token dropping past an expert's slots; None drops none, as DeepSpeed"),
    # ---- optimizer params (Adam / AdamW)
    Row("optimizer.params.lr", 1e-3, ADAM, given=OPT),
    Row("optimizer.params.betas", [0.9, 0.999], ADAM, given=OPT),
    Row("optimizer.params.eps", 1e-8, ADAM, given=OPT),
    Row("optimizer.params.weight_decay", 0.0, ADAM, given=OPT),
    Row("optimizer.params.weight_decay", 0.01,
        "runtime/engine.py:DeepSpeedEngine.get_optimizer_configuration (torch.optim.AdamW)",
        given={"optimizer": {"type": "Adam", "params": {"torch_adam": True}}},
        scope="torch_adam", note="torch_adam true, AdamW mode"),
    Row("optimizer.params.adam_w_mode", True, "runtime/config.py:ADAM_W_MODE_DEFAULT", given=OPT),
    Row("optimizer.params.bias_correction", True, ADAM, given=OPT),
    Row("optimizer.params.amsgrad", False, ADAM, given=OPT),
    Row("optimizer.params.torch_adam", False,
        "runtime/engine.py:DeepSpeedEngine.get_optimizer_configuration", given=OPT),
    # ---- schedulers
    *(
        Row(f"scheduler.params.{k}", v, f"{LRS}:WarmupLR.__init__", given=_sched("WarmupLR"),
            scope="WarmupLR")
        for k, v in [("warmup_min_lr", 0.0), ("warmup_num_steps", 1000),
                     ("warmup_type", "log"), ("last_batch_iteration", -1)]
    ),
    Row("scheduler.params.warmup_max_lr", None, f"{LRS}:WarmupLR.__init__",
        given=_sched("WarmupLR"), scope="WarmupLR", note="the optimizer's lr"),
    Row("scheduler.params.total_num_steps", REQUIRED, f"{LRS}:WarmupDecayLR.__init__",
        given=_sched("WarmupDecayLR"), scope="WarmupDecayLR"),
    *(
        Row(f"scheduler.params.{k}", v, f"{LRS}:WarmupDecayLR.__init__",
            given=_sched("WarmupDecayLR", total_num_steps=5000), scope="WarmupDecayLR")
        for k, v in [("warmup_min_lr", 0.0), ("warmup_max_lr", 0.001),
                     ("warmup_num_steps", 1000), ("warmup_type", "log"),
                     ("last_batch_iteration", -1)]
    ),
    Row("scheduler.params.total_num_steps", REQUIRED, f"{LRS}:WarmupCosineLR.__init__",
        given=_sched("WarmupCosineLR"), scope="WarmupCosineLR"),
    *(
        Row(f"scheduler.params.{k}", v, f"{LRS}:WarmupCosineLR.__init__",
            given=_sched("WarmupCosineLR", total_num_steps=5000), scope="WarmupCosineLR")
        for k, v in [("warmup_min_ratio", 0.0), ("warmup_num_steps", 1000),
                     ("cos_min_ratio", 0.0001), ("warmup_type", "log"),
                     ("last_batch_iteration", -1)]
    ),
    *(
        Row(f"scheduler.params.{k}", v, f"{LRS}:LRRangeTest.__init__",
            given=_sched("LRRangeTest"), scope="LRRangeTest")
        for k, v in [("lr_range_test_min_lr", 1e-3), ("lr_range_test_step_size", 2000),
                     ("lr_range_test_step_rate", 1.0), ("lr_range_test_staircase", False),
                     ("last_batch_iteration", -1)]
    ),
]  # fmt: skip


def _nested(key: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out  # type: ignore[no-any-return]


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read(cfg: DSConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        if isinstance(obj, dict):
            obj = obj[part]
        elif isinstance(obj, (list, tuple)):
            obj = obj[int(part)]
        else:
            obj = getattr(obj, part)
    return obj


def _load(config: dict[str, Any]) -> DSConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ignored-keys notice
        return load_config(config, 1)


@pytest.mark.parametrize("row", ROWS, ids=[r.ident for r in ROWS])
def test_default_matches_the_table(row: Row) -> None:
    if row.expected is ACCEPTED:
        _load(_merge(row.given, _nested(row.key, row.deepspeed)))
    elif row.expected is REQUIRED or row.expected is REFUSED:
        with pytest.raises(ConfigError, match=row.key.split(".")[-1]):
            _load(row.given)
    else:
        value = _read(_load(row.given), row.key)
        if isinstance(value, tuple):
            value = list(value)
        same_kind = isinstance(value, bool) == isinstance(row.expected, bool)
        assert value == row.expected and same_kind, (
            f"{row.ident}: ds_core {value!r}, table {row.expected!r}"
        )


def test_a_reason_exactly_where_ds_core_differs() -> None:
    for row in ROWS:
        differs = row.ds_core is not SAME and row.ds_core is not ACCEPTED
        assert bool(row.reason) == (differs or row.reason.startswith("same value")), row.ident


def test_rows_are_unique() -> None:
    idents = [r.ident for r in ROWS]
    assert len(idents) == len(set(idents))


def _sub_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section model an annotation holds, and whether it is a list of them."""
    origin = typing.get_origin(annotation)
    if origin is list:
        model, _ = _sub_model(typing.get_args(annotation)[0])
        return model, True
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            model, many = _sub_model(arg)
            if model is not None:
                return model, many
        return None, False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def _fields(model: type[BaseModel], prefix: str, scope: str = "") -> set[str]:
    """Idents of every field below ``model``: a section that is always present counts through
    its fields, an optional section or a list of them as a row of its own and its fields."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub, many = _sub_model(info.annotation)
        if key in ("optimizer", "scheduler"):  # their params are read by type, below
            out.add(key)
            continue
        if sub is not None and typing.get_origin(info.annotation) is None:
            out |= _fields(sub, f"{key}.", scope)
            continue
        out.add(f"{key}[{scope}]" if scope else key)
        if sub is not None:
            out |= _fields(sub, f"{key}.0." if many else f"{key}.", scope)
    return out


def test_every_field_has_a_row() -> None:
    fields = _fields(DSConfig, "") | _fields(OPTIMIZER_TYPES["Adam"], "optimizer.params.")
    assert OPTIMIZER_TYPES["AdamW"] is AdamParams
    for kind, model in SCHEDULER_TYPES.items():
        fields |= _fields(model, "scheduler.params.", kind)
    missing = sorted(fields - {r.ident for r in ROWS})
    assert not missing, f"fields without a row in the defaults table: {missing}"


def test_autocast_without_dtype_takes_torchs_default_for_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DeepSpeed passes dtype=None to torch.autocast, which picks the device type's default
    # (torch.get_autocast_dtype): bfloat16 on CPU, float16 on CUDA.
    import torch

    import ds_core

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_core.reset_accelerator()
    model = torch.nn.Linear(4, 4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "torch_autocast": {"enabled": True}}
    engine, _, _, _ = ds_core.initialize(model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), config=cfg)  # fmt: skip
    try:
        out = engine(torch.randn(2, 4))
        assert out.dtype == torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert model.weight.dtype == torch.float32
    finally:
        engine.destroy()
        ds_core.reset_accelerator()


# ---------------------------------------------------------------------------------------------
# the table in docs/from-deepspeed.md


def _show(value: Any) -> str:
    if isinstance(value, _Mark):
        return value.text
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1_000_000:
        digits = str(value).rstrip("0")
        if len(digits) <= 2:
            return f"`{int(digits)}e{len(str(value)) - len(digits)}`"
    return f"`{json.dumps(value)}`"


def render() -> str:
    """The docs table, one line per row."""
    lines = [
        "| key | DeepSpeed 0.19.8 | ds_core | DeepSpeed source | where ds_core differs, why |",
        "|---|---|---|---|---|",
    ]
    for r in ROWS:
        key = f"`{r.key}`" + (f" ({r.note})" if r.note else "")
        if r.scope and r.scope not in r.note and r.scope != "tb":
            key += f" [{r.scope}]"
        ds_core = "same" if r.ds_core is SAME else _show(r.ds_core)
        source = "—" if r.source == "-" else f"`{r.source}`"
        lines.append(f"| {key} | {_show(r.deepspeed)} | {ds_core} | {source} | {r.reason} |")
    return "\n".join(lines)


def test_docs_table_is_this_table() -> None:
    text = DOC.read_text()
    block = text.split("<!-- defaults-table -->\n")[1].split("\n<!-- /defaults-table -->")[0]
    assert block == render(), "regenerate with: python tests/zero/test_deepspeed_defaults.py"


if __name__ == "__main__":
    print(render())

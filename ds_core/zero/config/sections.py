"""Config sections added for DeepSpeed compatibility (``torch_autocast``,
``activation_checkpointing``, ``tensor_parallel``, ``expert_parallel``), apart from the core schema in :mod:`ds_core.zero.config`.
(Reading config files, JSON or hjson, is :mod:`ds_core.zero.config.files`.)"""

from __future__ import annotations

import difflib
import importlib.metadata as md
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, field_validator, model_validator

from ds_core.known_backends import KNOWN_BACKENDS
from ds_core.plugins import BACKEND_GROUP
from ds_core.zero.config.files import parse_config_text
from ds_core.zero.config.types import FROZEN as _FROZEN
from ds_core.zero.config.types import Bool, Int

__all__ = [
    "ActivationCheckpointingConfig",
    "LeafModuleConfig",
    "ExpertParallelConfig",
    "TPLayerSpecConfig",
    "TPPartitionConfig",
    "TensorParallelConfig",
    "TorchAutocastConfig",
    "accelerator_section_errors",
    "parse_config_text",
]


_AUTOCAST_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
}


class LeafModuleConfig(BaseModel):
    """``zero_optimization.leaf_module``: stage-3 modules gathered and released whole.

    A leaf module's parameters, its submodules' included, form its units (one unit up to
    ``reduce_bucket_size`` elements) and are gathered before its forward and its backward and
    released after, with no hooks on its submodules: one all-gather and one reduce-scatter
    per leaf where each submodule would issue its own (FSDP2's per-block ``fully_shard``).
    Fewer, larger collectives: cheaper where each collective has a fixed cost (small layers,
    bench/README.md "zero_vs_peers.py"), at the price of the whole leaf gathered at once. The
    outermost matching module is the leaf. The same keys as DeepSpeed 0.19.8
    (``runtime/zero/leaf_module_config.py``), whose default lists three ``transformers`` MoE
    blocks; ds_core's default is empty (no module is a leaf unless named). An entry that
    matches no module of the model is an error at ``initialize``."""

    model_config = _FROZEN

    classes: list[str] = []
    """Class names: ``Block``, ``pkg.module.Block`` (``__module__`` + ``__qualname__``)."""
    names: list[str] = []
    """Module names as ``model.named_modules()`` gives them (``blocks.0``)."""
    name_suffixes: list[str] = []
    """Module names ending so (``.mlp``)."""

    @model_validator(mode="before")
    @classmethod
    def _one_string(cls, data: Any) -> Any:
        # DeepSpeed accepts a single string for each list
        if isinstance(data, dict):
            return {k: [v] if isinstance(v, str) else v for k, v in data.items()}
        return data


class TorchAutocastConfig(BaseModel):
    """``torch_autocast``: run the forward under ``torch.autocast`` (parameters stay fp32)."""

    model_config = _FROZEN

    enabled: Bool = False
    dtype: str | None = None
    """The autocast dtype: ``bfloat16`` or ``float16`` (DeepSpeed's spellings accepted);
    ``None`` takes ``torch.autocast``'s default for the engine's device type (float16 on
    CUDA, bfloat16 on CPU). (Default: None, as DeepSpeed's ``get_torch_autocast_dtype``)"""
    lower_precision_safe_modules: list[str] | None = None
    """DeepSpeed reduces these modules' gradients in the autocast dtype; ds_core reduces in
    ``communication_data_type`` (fp32 by default) whatever the module. Accepted."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is not None and value not in _AUTOCAST_DTYPES:
            raise ValueError(f"must be one of {', '.join(_AUTOCAST_DTYPES)}, got {value!r}")
        return value

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype as a ``torch.dtype``; ``None`` for ``torch.autocast``'s device default."""
        if self.dtype is None:
            return None
        return getattr(torch, _AUTOCAST_DTYPES[self.dtype])  # type: ignore[no-any-return]


class ActivationCheckpointingConfig(BaseModel):
    """``activation_checkpointing``: read by :func:`ds_core.checkpointing.configure`, as
    DeepSpeed's; see that module for what each key does here."""

    model_config = _FROZEN

    partition_activations: Bool = False
    contiguous_memory_optimization: Bool = False
    number_checkpoints: Int | None = None
    cpu_checkpointing: Bool = False
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False


class PipelineConfig(BaseModel):
    """``pipeline``: DeepSpeed's pipeline-engine keys (its ``runtime/config.py``
    ``get_pipeline_config``), read when the model is a :class:`ds_core.pipe.PipelineModule`."""

    model_config = _FROZEN

    stages: Literal["auto"] | Int = "auto"
    """Pipeline stages; ``"auto"`` takes ``num_stages`` from the ``PipelineModule``. (Default: auto)"""
    partition: str = "best"
    """How layers are split over stages when the module does not say (DeepSpeed's key, kept for
    configs that carry it; the module's ``partition_method`` decides). (Default: best)"""
    seed_layers: Bool = False
    """Seed the RNG per layer while building it, so a layer's initial values do not depend on
    the stage it lands on. (Default: false)"""
    activation_checkpoint_interval: Int = Field(default=0, ge=0)
    """Checkpoint activations every this many layers in a stage; 0 never. (Default: 0)"""
    pipe_partitioned: Bool = True
    """DeepSpeed partitions activations sent between stages over the tensor-parallel group;
    accepted for configs that carry it. (Default: true)"""
    grad_partitioned: Bool = True
    """As ``pipe_partitioned``, for the gradients sent back. (Default: true)"""


def accelerator_section_errors(section: Any) -> list[str]:
    """Problems in ``accelerator``: each key must name a backend ds_core knows
    (:data:`~ds_core.known_backends.KNOWN_BACKENDS`) or one installed here (an entry point in
    ``ds_core.backends``). A config may carry sections for backends other than the one
    selected (only the selected one's is applied), but a misspelt or unknown name would
    otherwise be ignored without a word."""
    if not isinstance(section, dict):
        return []  # the schema reports the wrong type
    installed = {ep.name for ep in md.entry_points(group=BACKEND_GROUP)}
    known = sorted(set(KNOWN_BACKENDS) | installed)
    errors = []
    for name in section:
        if name not in known:
            match = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
            hint = f"; did you mean '{match[0]}'?" if match else ""
            errors.append(
                f"accelerator.{name}: no backend is named '{name}' (known or installed: "
                f"{', '.join(known)}){hint}"
            )
    return errors


_PARTITION_TYPES = ("column", "row", "skip", "replicate")


class TPLayerSpecConfig(BaseModel):
    """One ``tensor_parallel.partition_config.layer_specs`` entry (DeepSpeed's ``TPLayerSpec``):
    regular expressions matched with ``re.match`` against ``<full module path>.weight``, and
    how the matching ``nn.Linear`` is split. See :mod:`ds_core.parallel.tensor`."""

    model_config = _FROZEN

    patterns: list[str]
    partition_type: str = "column"
    """``column``, ``row``, or ``skip`` (DeepSpeed's word; ``replicate`` is a synonym)."""
    shape: list[int | list[int]] | None = None
    """``[k, -1]``: the weight holds ``k`` equal sub-parameters along dim 0 (a fused
    ``[q; k; v]`` is ``[3, -1]``), each split on its own; ``[[q, k, v], -1]``: sub-parameters
    of these sizes along dim 0 (rows; grouped-query attention's fused ``[q; k; v]``), each
    split on its own and re-fused. Other shapes (3-D views, ``partition_dim`` 1): not
    supported yet."""
    partition_dim: Int | None = None
    """Only the default is supported: 0 for column, 1 for row."""
    model_types: list[str] | None = None
    """Not supported yet (no model type is known to ds_core): must be absent."""
    gather_output: Bool = False
    """Column splits only: all-gather the output so every TP rank gets the whole of it (an
    untied LM head whose logits the loss reads whole). Not with a fused ``shape``."""

    @field_validator("patterns")
    @classmethod
    def _regexes(cls, value: list[str]) -> list[str]:
        import re

        if not value:
            raise ValueError("needs at least one pattern")
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    @field_validator("partition_type")
    @classmethod
    def _kind(cls, value: str) -> str:
        kind = value.lower()
        if kind not in _PARTITION_TYPES:
            raise ValueError(f"must be one of {', '.join(_PARTITION_TYPES)}, got {value!r}")
        return "skip" if kind == "replicate" else kind

    @field_validator("shape")
    @classmethod
    def _shape(cls, value: list[int | list[int]] | None) -> list[int | list[int]] | None:
        if value is None:
            return value
        first = value[0] if value else None
        ok = len(value) == 2 and value[1] == -1
        if isinstance(first, list):
            ok = ok and bool(first) and all(isinstance(n, int) and n > 0 for n in first)
        else:
            ok = ok and isinstance(first, int) and first >= 1
        if not ok:
            raise ValueError(
                "only [k, -1] (k equal fused sub-parameters along dim 0) or [[n1, n2, ...], -1] "
                f"(sub-parameters of these row counts) is supported, got {value!r}"
            )
        return value

    @field_validator("model_types")
    @classmethod
    def _no_model_types(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            raise ValueError("not supported yet (ds_core knows no model type); remove it")
        return value

    @model_validator(mode="after")
    def _gather_is_column(self) -> TPLayerSpecConfig:
        if self.gather_output and self.partition_type != "column":
            raise ValueError("gather_output needs partition_type column")
        default = {"column": 0, "row": 1}.get(self.partition_type)
        if self.partition_dim is not None and self.partition_dim != default:
            raise ValueError(
                f"partition_dim {self.partition_dim} with partition_type "
                f"{self.partition_type} is not supported yet; only the default ({default}) is"
            )
        return self


class TPPartitionConfig(BaseModel):
    """``tensor_parallel.partition_config`` (DeepSpeed's ``AutoTPConfig.from_dict`` keys)."""

    model_config = _FROZEN

    use_default_specs: Bool = True
    """Apply the name heuristics to Linear modules no ``layer_specs`` entry matches."""
    layer_specs: list[TPLayerSpecConfig] = []
    strict_mode: Bool = False
    """Fail when an ``nn.Linear`` is left unsplit without a spec saying ``skip``."""
    lm_head_patterns: list[str] = ["lm_head", "embed_out"]
    """Module names (last path component) the heuristics never split; a ``layer_specs`` entry
    can still split one (``column``, with ``gather_output`` for whole logits)."""
    embedding_partition_dim: Int = 1
    """Accepted for DeepSpeed configs and not used: an ``nn.Embedding`` is split only when a
    ``layer_specs`` entry names it (``partition_type row``: vocabulary rows split, output
    all-reduced); otherwise embeddings stay replicated."""
    tp_size: Int | None = None
    """DeepSpeed overwrites it with ``autotp_size``; if given it must equal that."""


class TensorParallelConfig(BaseModel):
    """``tensor_parallel``: AutoTP for training (DeepSpeed's ``TPTrainingConfig`` keys that
    ds_core implements; the others are refused in :mod:`ds_core.zero.config.deepspeed_keys`)."""

    model_config = _FROZEN

    autotp_size: Int = 0
    """Ranks each split layer is spread over; 0 or 1 disables AutoTP. (Default: 0)"""
    partition_config: TPPartitionConfig | None = None
    """Path patterns that override the name heuristics (see :mod:`ds_core.parallel.tensor`)."""

    @field_validator("autotp_size")
    @classmethod
    def _non_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value


class ExpertParallelConfig(BaseModel):
    """``expert_parallel``: AutoEP (DeepSpeed's ``AutoEPConfig`` keys that ds_core implements;
    ``use_grouped_mm`` and ``grouped_mm_backend`` are accepted and ignored, the others are
    refused where they would change results). See :mod:`ds_core.zero.autoep` and docs/from-deepspeed.md (AutoEP)."""

    model_config = _FROZEN

    enabled: Bool = False
    """Convert the model's MoE blocks inside ``initialize()``. (Default: false)"""
    autoep_size: Int = 1
    """Ranks each MoE layer's experts are split over (an EP group of adjacent data-parallel
    ranks); must divide the data-parallel size and every block's expert count. (Default: 1)"""
    preset_model: str | None = None
    """``mixtral``, ``qwen2_moe`` or ``qwen3_moe``: fixes the routing math (top-k weights
    renormalised for ``mixtral``; Qwen blocks read their ``norm_topk_prob``). ``None``
    detects it per block. DeepSpeed's ``deepseek_v2``/``deepseek_v3``/``llama4`` presets
    (sigmoid scores, grouped routing) are not supported yet."""
    moe_layer_pattern: str | None = None
    """A regular expression matched with ``re.fullmatch`` against full module paths: only
    these modules are converted, and each one must be a recognisable MoE block."""
    router_pattern: str | None = None
    """Child name of the router ``nn.Linear`` (default: ``gate``, else ``router``)."""
    expert_pattern: str | None = None
    """Child name of the experts' ``nn.ModuleList`` (default: ``experts``)."""
    top_k: Int | str = "auto"
    """Experts per token; ``auto`` reads the block's ``top_k`` / ``num_experts_per_tok``
    (or ``top_k_attr``), else 1."""
    top_k_attr: str | None = None
    """Attribute of the block holding its top-k (read when ``top_k`` is ``auto``)."""
    num_experts_attr: str | None = None
    """Attribute of the block holding its expert count; checked against the experts found."""
    route_norm: Bool | None = None
    """Renormalise the top-k weights to sum to 1; ``None`` follows the preset / the block."""
    route_scale: float = 1.0
    """Multiplies the routing weights."""
    routed_scaling_factor: float | str = "auto"
    """Multiplies the routing weights too; ``auto`` reads the block's attribute of that name,
    else 1.0."""
    score_func: str = "auto"
    """Only ``auto`` / ``softmax`` is supported (``sigmoid``: not supported yet)."""
    score_apply: str = "auto"
    """Only ``auto`` / ``post`` (weights applied to expert outputs) is supported."""
    num_expert_groups: Int | None = None
    """Grouped routing: not supported yet, must be absent."""
    num_limited_groups: Int | None = None
    """Grouped routing: not supported yet, must be absent."""
    load_balance_coeff: float | None = None
    """Auxiliary-loss-free expert-bias balancing: not supported yet, so only ``None`` (the
    default, as DeepSpeed 0.19.8's ``parse_autoep_config``, which refuses other values too)."""
    expert_w1: str | None = None
    """Name of an expert's first weight (``w1``, ``gate_proj``...); when given, every expert
    must have it (ds_core calls each expert module as it is, so it needs no weight layout)."""
    expert_w2: str | None = None
    """As ``expert_w1``, for the output weight."""
    expert_w3: str | None = None
    """As ``expert_w1``, for the third (up) weight."""
    has_shared_experts: Bool | None = None
    """Whether blocks carry a shared expert applied to every token; ``None`` detects it."""
    shared_experts_pattern: str | None = None
    """Child name of the shared expert (default: ``shared_expert`` or ``shared_experts``);
    a sibling ``<name>_gate`` ``nn.Linear`` to one output gates it by a sigmoid (Qwen2-MoE)."""
    capacity_factor: float | None = None
    """ds_core's key: slots per expert per rank are ``ceil(capacity_factor · tokens · top_k
    / num_experts)``; choices past an expert's slots are dropped (see docs/from-deepspeed.md (AutoEP)).
    ``None`` or 0 drops no token. (Default: None)"""

    @field_validator("autoep_size")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("preset_model")
    @classmethod
    def _preset(cls, value: str | None) -> str | None:
        if value is not None and value not in _EP_PRESETS:
            hint = (
                f"{NOT_YET_EP} (sigmoid scores / grouped routing)"
                if value in _EP_PRESETS_NOT_YET
                else f"must be one of {', '.join(_EP_PRESETS)}"
            )
            raise ValueError(f"{value!r}: {hint}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | str) -> int | str:
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise ValueError(f"must be 'auto' or an int >= 1, got {value!r}")
        return value

    @field_validator("routed_scaling_factor")
    @classmethod
    def _scaling(cls, value: float | str) -> float | str:
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"must be 'auto' or a number, got {value!r}")
        return value

    @field_validator("score_func")
    @classmethod
    def _score_func(cls, value: str) -> str:
        if value not in ("auto", "softmax"):
            raise ValueError(f"{value!r}: {NOT_YET_EP}; only 'auto' / 'softmax'")
        return value

    @field_validator("score_apply")
    @classmethod
    def _score_apply(cls, value: str) -> str:
        if value not in ("auto", "post"):
            raise ValueError(f"{value!r}: {NOT_YET_EP}; only 'auto' / 'post'")
        return value

    @field_validator("num_expert_groups", "num_limited_groups", "load_balance_coeff")
    @classmethod
    def _absent(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(f"{NOT_YET_EP} (it would change routing); remove it or set null")
        return value

    @field_validator("moe_layer_pattern")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        import re

        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
        return value

    @field_validator("capacity_factor")
    @classmethod
    def _capacity(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0 (0 or null: drop no token), got {value}")
        return value


NOT_YET_EP = "not supported yet"
_EP_PRESETS = ("mixtral", "qwen2_moe", "qwen3_moe")
_EP_PRESETS_NOT_YET = ("deepseek_v2", "deepseek_v3", "llama4", "qwen3_5_moe")

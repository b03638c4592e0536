"""AutoTP: tensor parallelism for training, applied to an unmodified model.

:func:`apply_autotp` (called by :func:`ds_core.initialize` when the config has
``tensor_parallel.autotp_size`` > 1) and :func:`tp_model_init` (DeepSpeed's function form)
replace ``nn.Linear`` modules by tensor-parallel ones over the TP group of
:func:`ds_core.comm.device_mesh` (TP ranks adjacent: ``tp_rank = rank % tp_size``):

- **column-parallel** (:class:`LinearColumnParallel`; q/k/v, gate/up projections): output
  features and bias split; the input passes through :class:`CopyToTP` (identity forward,
  all-reduce of its gradient backward) so each rank's input gradient becomes the full one;
  the output stays sharded. A fused weight of ``k`` equal sub-parameters (``[q; k; v]``,
  ``[gate; up]``) splits each sub-parameter, so every rank keeps matching slices of each.
- **row-parallel** (:class:`LinearRowParallel`; o/down projections): input features split;
  the partial outputs are summed by :class:`ReduceFromTP` (all-reduce forward, identity
  backward) and the bias, kept whole and replicated, is added once after the sum.

Both collectives go through the accelerator facade's ``all_reduce`` (the comm hooks).

**Which modules.** With no partition config, or with ``use_default_specs`` true for modules no
spec matches, the name heuristics apply: inside one parent module, children named like a
column projection (``q_proj k_proj v_proj query key value gate_proj up_proj fc1 fc c_fc fc_in
w1 w3 dense_h_to_4h``; fused ``qkv qkv_proj c_attn Wqkv`` as 3 sub-parameters, ``gate_up_proj``
as 2) are split column-wise and children named like an output projection (``o_proj
down_proj out_proj c_proj proj fc2 fc_out w2 dense_4h_to_h``) row-wise — but only when the
parent has both kinds, so a lone ``proj`` or ``fc`` elsewhere stays replicated.
``lm_head_patterns`` names are never split; embeddings, norms and every other parameter stay
replicated. A partition config's ``layer_specs`` override the heuristics: each entry's
``patterns`` are **regular expressions** matched with ``re.match`` (anchored at the start, as
DeepSpeed does) against ``<full module path>.weight``, e.g. ``model\\.layers\\.0\\.mlp\\.up_proj
\\.weight`` or ``.*\\.self_attn\\.[qkv]_proj\\.weight$``; the first matching entry decides
(``column``, ``row``, or ``skip`` / ``replicate``). A pattern matching no module, a split of a
module that is not an ``nn.Linear``, or a dimension not divisible by the TP size is a
:class:`~ds_core.ConfigError` naming it.

**Attention heads.** A column split of q/k/v must keep whole heads on each rank. The parent of
split attention projections (a module with a column-split ``q_proj``/``k_proj``/``v_proj``/
``query``/``key``/``value`` or fused ``qkv`` child) has each of its integer attributes
``num_heads n_head n_heads num_attention_heads num_key_value_heads num_kv_heads n_kv_heads
n_kv_head`` divided by the TP size (an error when one is not divisible), so an attention that
reshapes with its head count computes with its local heads. An attention that reshapes with
``-1`` and a head dimension needs nothing; one that uses a width attribute (``hidden_size``,
``embed_dim``) in its reshape must derive it from the tensor instead (``view(B, T, -1)``).

**With ZeRO.** Split parameters carry :data:`TP_ATTR`; the engine partitions every parameter
over the DP group only, averages gradients over the DP size, and counts TP shards once each in
the gradient norm (summed over the whole mesh) and replicated parameters once (on TP rank 0),
since their gradients are equal on every TP rank: every rank of a TP group sees the same
batch and the same full activations.

**Checkpoints.** ``save_checkpoint(..., universal=True)`` stores each split parameter once,
gathered to its full name and shape (:data:`TP_ATTR` and :data:`TP_FUSED_ATTR` say how), and
a load at any TP size cuts it again; see [Note: TP in checkpoints] in
:mod:`ds_core.checkpoint._tp`. A native-format save of a TP engine is refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core import comm
from ds_core.accelerator import get_accelerator
from ds_core.comm.mesh import Mesh, device_mesh
from ds_core.errors import ConfigError

__all__ = [
    "TP_ATTR",
    "TP_FUSED_ATTR",
    "CopyToTP",
    "LinearColumnParallel",
    "LinearRowParallel",
    "ReduceFromTP",
    "apply_autotp",
    "is_tp_sharded",
    "model_tp_size",
    "replaced_parameters",
    "tp_model_init",
]

log = logging.getLogger("ds_core.tp")

#: attribute on a tensor-parallel parameter: ``"column"`` or ``"row"`` (its values differ on
#: each TP rank). Replicated parameters (including a row-parallel layer's bias) lack it.
TP_ATTR = "ds_tensor_parallel"
#: attribute on a column-parallel parameter of a fused weight: its number of equal
#: sub-parameters along dim 0 (``[q; k; v]``: 3), each split separately; absent means 1.
TP_FUSED_ATTR = "ds_tensor_parallel_fused"
#: :data:`ds_core.moe.EXPERT_ATTR` (not imported: ds_core.moe imports the accelerator early).
_EXPERT = "ds_expert_parallel_size"
#: attribute on the root module of a converted model: its TP size.
_MODEL_ATTR = "ds_autotp_size"
#: attribute on the root module: ``id(replaced parameter) -> its shard``.
_REPLACED_ATTR = "ds_autotp_replaced"

_COLUMN = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "gate_proj",
        "up_proj",
        "fc1",
        "fc",
        "c_fc",
        "fc_in",
        "w1",
        "w3",
        "dense_h_to_4h",
    }
)
#: fused column projections: leaf name -> equal sub-parameters along dim 0.
_FUSED = {"qkv": 3, "qkv_proj": 3, "c_attn": 3, "Wqkv": 3, "gate_up_proj": 2}
_ROW = frozenset(
    {"o_proj", "down_proj", "out_proj", "c_proj", "proj", "fc2", "fc_out", "w2", "dense_4h_to_h"}
)
_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv", "qkv_proj"})
_ATTENTION |= {"c_attn", "Wqkv"}
_HEAD_ATTRS = (
    "num_heads",
    "n_head",
    "n_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "n_kv_head",
)


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` holds a tensor-parallel shard (differs on each TP rank)."""
    return getattr(param, TP_ATTR, None) is not None


def replaced_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """``id(original parameter) -> the shard replacing it`` for a converted model, so an
    optimizer built over the parameters before the split still names them."""
    return dict(getattr(model, _REPLACED_ATTR, {}))


def model_tp_size(model: nn.Module) -> int:
    """The TP size ``model`` was converted with (1 when it was not)."""
    return int(getattr(model, _MODEL_ATTR, 1))


# --------------------------------------------------------------------------- collectives


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    out = t.contiguous().clone()
    get_accelerator().all_reduce(out, "sum", group, False).wait()
    return out


class CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient is all-reduced over the TP group (a column-parallel
    layer's input: each rank's partial input gradient becomes the full one)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _all_reduce(grad, ctx.group)


class ReduceFromTP(torch.autograd.Function):
    """All-reduce over the TP group forward (a row-parallel layer's partial outputs); the
    gradient passes through unchanged (every rank's output gradient is already the full one)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


# --------------------------------------------------------------------------- layers


class LinearColumnParallel(nn.Module):
    """This rank's output slice of a Linear: ``y_local = x · W_localᵀ + b_local``.

    ``in_features`` is the full input width; ``out_features`` the local output width.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mesh: Mesh,
        requires_grad: bool,
        fused: int = 1,
    ) -> None:
        super().__init__()
        self.group = mesh.tp_group
        self.tp_size = mesh.tp_size
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        for p in (self.weight, self.bias):
            if p is not None:
                setattr(p, TP_ATTR, "column")
                setattr(p, TP_FUSED_ATTR, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            x = CopyToTP.apply(self.group, x)  # type: ignore[no-untyped-call]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local)"


class LinearRowParallel(nn.Module):
    """A Linear over this rank's input slice, partial outputs summed over the TP group, then
    the whole (replicated) bias added once. ``in_features`` is the local input width."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: Mesh, requires_grad: bool
    ) -> None:
        super().__init__()
        self.group = mesh.tp_group
        self.tp_size = mesh.tp_size
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        setattr(self.weight, TP_ATTR, "row")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            y = ReduceFromTP.apply(self.group, y)  # type: ignore[no-untyped-call]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}"


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Split:
    kind: str  # "column" | "row" | "skip"
    fused: int = 1  # equal sub-parameters along dim 0 (column only)
    source: str = "heuristic"


def _get(cfg: Any, key: str, default: Any) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _specs(partition_config: Any) -> list[tuple[list[str], _Split]]:
    out = []
    for i, spec in enumerate(_get(partition_config, "layer_specs", []) or []):
        kind = str(_get(spec, "partition_type", "column")).lower()
        kind = "skip" if kind == "replicate" else kind
        if kind not in ("column", "row", "skip"):
            raise ConfigError(
                f"tensor_parallel.partition_config.layer_specs.{i}.partition_type: must be "
                f"column, row or skip, got {kind!r}"
            )
        shape = _get(spec, "shape", None)
        fused = int(shape[0]) if shape else 1
        patterns = list(_get(spec, "patterns", []))
        out.append((patterns, _Split(kind, fused, f"layer_specs.{i}")))
    return out


def plan_autotp(model: nn.Module, tp_size: int, partition_config: Any = None) -> dict[str, _Split]:
    """Decide each ``nn.Linear``'s split (module path → split), without changing the model.

    :raises ConfigError: a pattern matching no module, a spec splitting a module that is not an
        ``nn.Linear``, or ``strict_mode`` with a Linear left undecided.
    """
    modules = dict(model.named_modules())
    specs = _specs(partition_config)
    use_defaults = bool(_get(partition_config, "use_default_specs", True))
    lm_heads = set(_get(partition_config, "lm_head_patterns", ["lm_head", "embed_out"]))
    hits: dict[str, int] = {p: 0 for patterns, _ in specs for p in patterns}
    decided: dict[str, _Split] = {}
    for path, mod in modules.items():
        if not path:
            continue
        for patterns, split in specs:
            try:
                matched = [p for p in patterns if re.match(p, f"{path}.weight")]
            except re.error as exc:
                raise ConfigError(
                    f"tensor_parallel.partition_config.{split.source}.patterns: not a regular "
                    f"expression: {exc}"
                ) from None
            if not matched:
                continue
            for p in matched:
                hits[p] += 1
            if split.kind != "skip" and not isinstance(mod, nn.Linear):
                raise ConfigError(
                    f"tensor_parallel.partition_config.{split.source}: {matched[0]!r} matches "
                    f"{path} ({type(mod).__name__}); only nn.Linear modules can be split "
                    "(embeddings and other layers stay replicated)"
                )
            if path not in decided:  # the first matching spec decides, as in DeepSpeed
                decided[path] = split
    unmatched = [p for p, n in hits.items() if n == 0]
    if unmatched:
        sample = ", ".join(f"{p}.weight" for p in list(modules)[1:4])
        raise ConfigError(
            f"tensor_parallel.partition_config: pattern(s) {', '.join(map(repr, unmatched))} "
            f"match no module; patterns are regular expressions matched (re.match) against "
            f"full paths such as {sample}"
        )
    if use_defaults:
        by_parent: dict[str, list[str]] = {}
        for path, mod in modules.items():
            # AutoEP's experts stay whole: their ranks exchange tokens, not activations' halves.
            expert = getattr(mod, "weight", None) is not None and hasattr(mod.weight, _EXPERT)
            if isinstance(mod, nn.Linear) and path not in decided and not expert:
                parent, _, leaf = path.rpartition(".")
                if leaf not in lm_heads:
                    by_parent.setdefault(parent, []).append(path)
        spec_kinds: dict[str, set[str]] = {}
        for path, split in decided.items():
            spec_kinds.setdefault(path.rpartition(".")[0], set()).add(split.kind)
        for parent, children in by_parent.items():
            leaves = {c: c.rpartition(".")[2] for c in children}
            cols = [c for c, n in leaves.items() if n in _COLUMN or n in _FUSED]
            rows = [c for c, n in leaves.items() if n in _ROW]
            # Siblings a spec split count: a spec'd up_proj makes its gate_proj's pair.
            has_col = bool(cols) or "column" in spec_kinds.get(parent, set())
            has_row = bool(rows) or "row" in spec_kinds.get(parent, set())
            if has_col and has_row:
                for c in cols:
                    decided[c] = _Split("column", _FUSED.get(leaves[c], 1))
                for r in rows:
                    decided[r] = _Split("row")
    if bool(_get(partition_config, "strict_mode", False)):
        left = [p for p, m in modules.items() if isinstance(m, nn.Linear) and p not in decided]
        if left:
            raise ConfigError(
                f"tensor_parallel.partition_config.strict_mode: no spec or heuristic decides "
                f"{', '.join(left)}; add a layer_specs entry (partition_type skip to keep one "
                "replicated)"
            )
    return {p: s for p, s in decided.items() if isinstance(modules[p], nn.Linear)}


# --------------------------------------------------------------------------- conversion


def _slice_rows(t: torch.Tensor, fused: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    sub = t.reshape(fused, t.shape[0] // fused, *t.shape[1:])
    piece = sub.chunk(tp_size, dim=1)[tp_rank]
    return piece.reshape(-1, *t.shape[1:]).clone()


def apply_autotp(model: nn.Module, mesh: Mesh, partition_config: Any = None) -> dict[str, str]:
    """Split ``model``'s linear layers over ``mesh``'s TP group in place (see the module doc).

    Every rank must call it on the same model; each full weight is broadcast from rank 0 before
    it is cut, so the shards are slices of one tensor. Returns module path → ``"column"`` /
    ``"row"`` for each split module.

    :raises ConfigError: as :func:`plan_autotp`; a dimension or head count not divisible by the
        TP size (naming the module); a model already converted with another size. (The
        engine refuses models built under ``zero.Init``: not supported yet.)
    """
    tp = mesh.tp_size
    done = model_tp_size(model)
    if done != 1:
        if done != tp:
            raise ConfigError(
                f"the model was already split for tensor parallelism over {done} ranks; "
                f"tensor_parallel.autotp_size is {tp}"
            )
        return {}
    if tp == 1:
        return {}
    cfg_tp = _get(partition_config, "tp_size", None)
    if cfg_tp is not None and cfg_tp != tp:
        raise ConfigError(
            f"tensor_parallel.partition_config.tp_size is {cfg_tp} but autotp_size is {tp}; "
            "drop tp_size (DeepSpeed overwrites it with autotp_size)"
        )
    plan = plan_autotp(model, tp, partition_config)
    acc = get_accelerator()
    world = comm.get_world_size()
    result: dict[str, str] = {}
    replaced: dict[int, nn.Parameter] = {}
    heads_done: set[str] = set()
    for path, split in plan.items():
        if split.kind == "skip":
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        lin = getattr(parent, leaf)
        assert isinstance(lin, nn.Linear)
        w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
        out_f, in_f = w.shape
        if split.kind == "column" and out_f % (split.fused * tp):
            what = f"{split.fused} fused sub-parameters of " if split.fused > 1 else ""
            raise ConfigError(
                f"{path}: {what}out_features {out_f} cannot be split over autotp_size {tp} "
                f"(column split needs a multiple of {split.fused * tp})"
            )
        if split.kind == "row" and in_f % tp:
            raise ConfigError(
                f"{path}: in_features {in_f} is not divisible by autotp_size {tp} (row split)"
            )
        if world > 1:
            w = w.contiguous().clone()
            acc.broadcast(w, 0, None)
            if b is not None:
                b = b.contiguous().clone()
                acc.broadcast(b, 0, None)
        grad = lin.weight.requires_grad
        new: nn.Module
        if split.kind == "column":
            bias = None if b is None else _slice_rows(b, split.fused, tp, mesh.tp_rank)
            new = LinearColumnParallel(
                _slice_rows(w, split.fused, tp, mesh.tp_rank), bias, mesh, grad, split.fused
            )
            if leaf in _ATTENTION and parent_path not in heads_done:
                _local_heads(parent, parent_path or "<model>", tp)
                heads_done.add(parent_path)
        else:
            piece = w.chunk(tp, dim=1)[mesh.tp_rank].clone()
            new = LinearRowParallel(piece, None if b is None else b.clone(), mesh, grad)
        setattr(parent, leaf, new)
        result[path] = split.kind
        replaced[id(lin.weight)] = new.weight
        if lin.bias is not None:
            replaced[id(lin.bias)] = new.bias  # type: ignore[assignment]
    setattr(model, _MODEL_ATTR, tp)
    setattr(model, _REPLACED_ATTR, replaced)
    log.info("AutoTP over %d ranks: %s", tp, ", ".join(f"{p}={k}" for p, k in result.items()))
    return result


def _local_heads(module: nn.Module, path: str, tp: int) -> None:
    found = False
    for attr in _HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % tp:
                raise ConfigError(
                    f"{path}.{attr} = {value} is not divisible by autotp_size {tp}: a column "
                    "split of the attention projections must keep whole heads on each rank"
                )
            setattr(module, attr, value // tp)
            found = True
    if not found:
        log.info(
            "AutoTP: %s has no head-count attribute (%s); its attention must derive the "
            "local head count from the projections' shapes",
            path,
            ", ".join(_HEAD_ATTRS),
        )


def tp_model_init(
    model: nn.Module,
    tp_size: int,
    dtype: torch.dtype | None = None,
    partition_config: Any = None,
) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: split ``model`` over ``tp_size`` ranks now
    (collective: every rank calls it), cast it to ``dtype`` when given, and return it. A later
    :func:`ds_core.initialize` trains it with ZeRO over the data-parallel groups; its config
    may omit ``tensor_parallel`` or give the same ``autotp_size``.

    :param partition_config: a ``tensor_parallel.partition_config`` dict (or its parsed form).
    :raises ConfigError: as :func:`apply_autotp`.
    :raises ValueError: ``tp_size`` does not divide the world size.
    """
    comm.init_distributed()
    apply_autotp(model, device_mesh(tp_size), partition_config)
    if dtype is not None:
        model.to(dtype)
    return model

"""AutoTP's planning (which ``nn.Linear`` splits how) and the in-place conversion of a model
(see :mod:`ds_core.parallel.tensor`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ds_core import comm
from ds_core.accelerator import get_accelerator
from ds_core.comm.mesh import Mesh, device_mesh
from ds_core.errors import ConfigError
from ds_core.parallel.tensor.layers import (
    Fused,
    LinearColumnParallel,
    LinearRowParallel,
    VocabParallelEmbedding,
    slice_rows,
    sub_sizes,
)

log = logging.getLogger("ds_core.parallel.tensor")

#: :data:`ds_core.parallel.expert.moe.EXPERT_ATTR` (not imported: ds_core.parallel.expert.moe imports the accelerator early).
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
_Q_HEADS = ("num_heads", "n_head", "n_heads", "num_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_HEAD_ATTRS = _Q_HEADS + _KV_HEADS


def replaced_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """``id(original parameter) -> the shard replacing it`` for a converted model, so an
    optimizer built over the parameters before the split still names them."""
    return dict(getattr(model, _REPLACED_ATTR, {}))


def model_tp_size(model: nn.Module) -> int:
    """The TP size ``model`` was converted with (1 when it was not)."""
    return int(getattr(model, _MODEL_ATTR, 1))


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Split:
    kind: str  # "column" | "row" | "skip"
    fused: Fused = 1  # sub-parameters along dim 0 (column only): a count or their sizes
    source: str = "heuristic"
    gather_output: bool = False


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
        fused: Fused = 1
        if shape:
            try:  # a dict given to tp_model_init has not been through the config's schema
                fused = (
                    tuple(int(n) for n in shape[0])
                    if isinstance(shape[0], list | tuple)
                    else int(shape[0])
                )
            except (TypeError, ValueError):
                raise ConfigError(
                    f"tensor_parallel.partition_config.layer_specs.{i}.shape: the first entry "
                    f"must be a sub-parameter count or a list of sizes, got {shape[0]!r}"
                ) from None
        patterns = list(_get(spec, "patterns", []))
        gather = bool(_get(spec, "gather_output", False))
        out.append((patterns, _Split(kind, fused, f"layer_specs.{i}", gather)))
    return out


def plan_autotp(model: nn.Module, tp_size: int, partition_config: Any = None) -> dict[str, _Split]:
    """Decide each ``nn.Linear``'s split (module path → split), without changing the model.

    An ``nn.Embedding`` is split only when a spec asks, with ``row`` (its vocabulary rows).

    :raises ConfigError: a pattern matching no module, a spec splitting a module that is not an
        ``nn.Linear`` or ``nn.Embedding`` (or an embedding other than ``row``), or
        ``strict_mode`` with a Linear left undecided.
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
            where = f"tensor_parallel.partition_config.{split.source}"
            if split.kind != "skip" and not isinstance(mod, nn.Linear | nn.Embedding):
                raise ConfigError(
                    f"{where}: {matched[0]!r} matches {path} ({type(mod).__name__}); only "
                    "nn.Linear and nn.Embedding modules can be split"
                )
            if isinstance(mod, nn.Embedding) and split.kind == "column":
                raise ConfigError(
                    f"{where}: {path} is an nn.Embedding; it splits its vocabulary rows "
                    "(partition_type row, all-reduced output); a split of its embedding "
                    "dimension is not supported yet"
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
                    fused: Fused = _FUSED.get(leaves[c], 1)
                    if fused == 3:
                        fused = _qkv_sizes(modules[parent], modules[c], c)
                    decided[c] = _Split("column", fused)
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
    return {p: s for p, s in decided.items() if isinstance(modules[p], nn.Linear | nn.Embedding)}


def _heads(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for attr in names:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _qkv_sizes(attn: nn.Module, qkv: nn.Module, path: str) -> Fused:
    """A fused ``[q; k; v]``'s sub-parameter sizes: equal thirds, or ``(q, kv, kv)`` when its
    parent says it has fewer key/value heads than query heads (grouped-query attention)."""
    heads, kv = _heads(attn, _Q_HEADS), _heads(attn, _KV_HEADS)
    if heads is None or kv is None or kv == heads or not isinstance(qkv, nn.Linear):
        return 3
    rows = qkv.out_features
    if rows % (heads + 2 * kv):
        raise ConfigError(
            f"{path}: out_features {rows} is not (num_heads {heads} + 2 × num_kv_heads {kv}) "
            "× head_dim; give its layout with a layer_specs entry (shape [[q, k, v], -1])"
        )
    dim = rows // (heads + 2 * kv)
    return (heads * dim, kv * dim, kv * dim)


# --------------------------------------------------------------------------- conversion


def apply_autotp(model: nn.Module, mesh: Mesh, partition_config: Any = None) -> dict[str, str]:
    """Split ``model``'s linear layers over ``mesh``'s TP group in place (see the module doc).

    Every rank must call it on the same model (with pipeline stages: every rank of a stage on
    that stage's layers); each full weight is broadcast from rank 0 (with stages, from the TP
    group's first rank) before it is cut, so the shards are slices of one tensor. Returns
    module path → ``"column"`` / ``"row"`` for each split module.

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
    _check_ties(model, plan)
    acc = get_accelerator()
    world = comm.get_world_size()
    # Pipeline stages hold other layers, so a stage's weights come from its TP group's first
    # rank (ds_core.parallel.pipeline.topology); placement then makes the shards equal over
    # the stage's DP group (ds_core/zero/placement.py).
    src, group = (mesh.tp_src, mesh.tp_group) if mesh.pp_size > 1 else (0, None)
    result: dict[str, str] = {}
    replaced: dict[int, nn.Parameter] = {}
    heads_done: set[str] = set()
    for path, split in plan.items():
        if split.kind == "skip":
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, leaf)
        _check_divisible(path, old, split, tp)
        w, b = old.weight.detach(), getattr(old, "bias", None)
        b = None if b is None else b.detach()
        if world > 1:
            w = w.contiguous().clone()
            acc.broadcast(w, src, group)
            if b is not None:
                b = b.contiguous().clone()
                acc.broadcast(b, src, group)
        grad = old.weight.requires_grad
        # A tied weight (embedding and LM head) becomes one shard Parameter in both modules.
        shared = replaced.get(id(old.weight))
        new: nn.Module
        if isinstance(old, nn.Embedding):
            new = VocabParallelEmbedding(
                slice_rows(w, 1, tp, mesh.tp_rank).clone(), old, mesh, grad
            )
            if shared is not None:
                new.weight = shared
        elif split.kind == "column":
            bias = None if b is None else slice_rows(b, split.fused, tp, mesh.tp_rank).clone()
            piece = slice_rows(w, split.fused, tp, mesh.tp_rank).clone()
            new = LinearColumnParallel(
                piece, bias, mesh, grad, split.fused, split.gather_output, shared
            )
            if leaf in _ATTENTION and parent_path not in heads_done:
                _local_heads(parent, parent_path or "<model>", tp)
                heads_done.add(parent_path)
        else:
            piece = w.chunk(tp, dim=1)[mesh.tp_rank].clone()
            new = LinearRowParallel(piece, None if b is None else b.clone(), mesh, grad)
        setattr(parent, leaf, new)
        result[path] = split.kind
        replaced[id(old.weight)] = new.weight
        if getattr(old, "bias", None) is not None:
            replaced[id(old.bias)] = new.bias  # type: ignore[assignment]
    setattr(model, _MODEL_ATTR, tp)
    setattr(model, _REPLACED_ATTR, replaced)
    log.info("AutoTP over %d ranks: %s", tp, ", ".join(f"{p}={k}" for p, k in result.items()))
    return result


def _check_divisible(path: str, mod: nn.Module, split: _Split, tp: int) -> None:
    """Refuse, naming ``path``, a split the shapes or the layout do not allow."""
    if isinstance(mod, nn.Embedding):
        if mod.num_embeddings % tp:
            raise ConfigError(
                f"{path}: vocabulary size {mod.num_embeddings} is not divisible by autotp_size "
                f"{tp} (vocab-parallel embedding); pad the vocabulary to a multiple of {tp}"
            )
        if mod.max_norm is not None or mod.sparse:
            raise ConfigError(
                f"{path}: a vocab-parallel split of an nn.Embedding with max_norm or sparse "
                "gradients is not supported yet; keep it replicated (partition_type skip)"
            )
        return
    assert isinstance(mod, nn.Linear)  # plan_autotp keeps only Linear and Embedding
    out_f, in_f = mod.weight.shape
    if split.kind == "row":
        if in_f % tp:
            raise ConfigError(
                f"{path}: in_features {in_f} is not divisible by autotp_size {tp} (row split)"
            )
        return
    sizes = sub_sizes(split.fused, out_f)
    if isinstance(split.fused, int) and out_f % split.fused:
        sizes = ()
    if sum(sizes) != out_f:
        raise ConfigError(
            f"{path}: out_features {out_f} does not hold the sub-parameters of "
            f"{split.source}'s shape ({split.fused}); fix its shape"
        )
    if any(n % tp for n in sizes):
        what = f"sub-parameters {list(sizes)} of " if len(sizes) > 1 else ""
        raise ConfigError(
            f"{path}: {what}out_features {out_f} cannot be split over autotp_size {tp} "
            f"(a column split needs each sub-parameter to be a multiple of {tp})"
        )
    if split.gather_output and len(sizes) > 1:
        raise ConfigError(
            f"{path}: gather_output with a fused weight ({split.source}) is not supported yet; "
            "split its parts into separate Linear modules or drop gather_output"
        )


def _layout(mod: nn.Module, split: _Split | None) -> tuple[str, Fused] | None:
    if split is None or split.kind == "skip":
        return None
    if isinstance(mod, nn.Embedding):
        return ("column", 1)  # vocabulary rows: dim 0, like a column-split LM head
    return ("column", split.fused) if split.kind == "column" else ("row", 1)


def _check_ties(model: nn.Module, plan: dict[str, _Split]) -> None:
    """A weight shared by several modules (a tied embedding and LM head) must be split the
    same way in all of them, or in none; otherwise refuse naming them."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        w = getattr(mod, "weight", None)
        if isinstance(w, nn.Parameter) and isinstance(mod, nn.Linear | nn.Embedding):
            owners.setdefault(id(w), []).append((path, mod))
    for tied in owners.values():
        if len(tied) < 2:
            continue
        layouts = {_layout(m, plan.get(p)) for p, m in tied}
        if len(layouts) > 1:
            names = " and ".join(f"{p}.weight" for p, _ in tied)
            raise ConfigError(
                f"tensor_parallel.partition_config: {names} are tied (one Parameter) but split "
                "differently; split both over the vocabulary (the embedding partition_type "
                "row, the LM head column) or neither"
            )


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

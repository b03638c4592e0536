"""AutoEP: expert parallelism applied to an unmodified mixture-of-experts model.

:func:`apply_autoep` (called by :func:`ds_core.initialize` when ``expert_parallel.enabled``
is true) and :func:`autoep_model_init` (its function form) find the model's MoE blocks and
replace each by an :class:`ExpertParallelMoE` whose experts are spread over an EP group of
``autoep_size`` adjacent ranks (the groups of :func:`ds_core.parallel.expert.moe.expert_groups`).

**Which modules.** A block is a module with a router ``nn.Linear`` child (``gate``, else
``router``; ``router_pattern`` names another) to ``E`` outputs and an ``nn.ModuleList`` child
of ``E`` expert modules (``experts``; ``expert_pattern``). That covers Mixtral-style
``block_sparse_moe`` (experts with ``w1/w2/w3``), Qwen-MoE-style ``mlp`` (experts with
``gate_proj/up_proj/down_proj``, optionally a ``shared_expert`` gated by
``shared_expert_gate``) and the GPT example's ``--moe`` blocks. The experts are called as the
modules they are, so any expert MLP works. With ``moe_layer_pattern`` only modules whose full
path matches it (``re.fullmatch``) are converted, and one that is not such a block is a
:class:`~ds_core.ConfigError` naming it, as is a pattern matching nothing, an expert count
not divisible by ``autoep_size``, or an ``autoep_size`` that does not divide the
data-parallel size.

**Routing** is the original block's math: ``softmax`` of the router logits in fp32, the top-k
experts per token, their weights renormalised to sum to one when ``route_norm`` (Mixtral:
always; Qwen: the block's ``norm_topk_prob``; otherwise not), times ``route_scale`` and
``routed_scaling_factor``, cast to the input dtype; the output is the weighted sum of the
chosen experts' outputs (plus the shared expert's, when there is one). The block returns
``(output, router_logits)`` when the original did (probed once with one zero token).

**Dispatch and combine.** Each rank fills, for every expert, ``C`` slots of its own tokens,
exchanges them with one all-to-all over the EP group (rank ``i`` receives every rank's slots
for its ``E / autoep_size`` local experts), runs its local experts and returns the outputs by
a second all-to-all; the backward pass is the same two exchanges reversed. Both go through the
accelerator facade's ``all_to_all`` (the comm hooks). Slots are filled first by every token's
first choice in token order, then by second choices, and so on.

**Capacity.** With ``capacity_factor`` null or 0 (the default), ``C`` is the rank's token
count, so no choice is ever dropped and the layer computes exactly what the original block
does. With ``capacity_factor = f > 0``, ``C = min(T, max(1, ceil(f · T · k / E)))`` for ``T``
tokens on the rank: a choice finding its expert's ``C`` slots taken is dropped — it adds
nothing and the token's other weights are not renormalised, so a token all of whose choices
are dropped gets a zero routed output (its residual connection, and the shared expert, still
apply). All ranks of an EP group must feed the same number of tokens per micro-batch.

**Gradients.** Local experts' parameters are marked with :func:`ds_core.parallel.expert.moe.mark_expert`; the
ZeRO engine reduces them over their expert-data-parallel group and divides their gradient by
the data-parallel size (every rank's loss reaches them through the all-to-all), while the
router and shared expert stay dense and are averaged over the data-parallel group.

**With AutoTP** (``tensor_parallel.autotp_size`` T): AutoTP's heuristics leave expert
linears whole, so each expert is replicated on the T ranks of a TP group (which see the same
tokens); the EP and EDP groups run along the data-parallel dimension inside one TP
coordinate (:func:`ds_core.parallel.expert.moe.expert_groups` with ``tp_size``), and the engine counts an
expert once per TP group in the gradient norm, as any TP-replicated parameter.

**Checkpoints** store each expert parameter under its global expert index (recorded with
:func:`ds_core.parallel.expert.moe.mark_expert_index`; see :func:`ds_core.checkpoint._state.param_key`), so
they reload at any EP size.

**Values and zero.Init.** As for dense parameters, rank 0's values win: :func:`apply_autoep`
broadcasts each expert parameter from rank 0 (one at a time, in the same order on every
rank) before keeping only this rank's experts. Parameters built under
:class:`ds_core.zero.Init` are construction shards (cut from rank 0's values); each expert
parameter is rebuilt from them the same way, so the engine places the kept ones as ordinary
expert parameters, and the router and shared expert stay partitioned until then.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core import comm
from ds_core.accelerator import get_accelerator
from ds_core.errors import ConfigError
from ds_core.parallel.expert.moe import (
    DROPPED_ATTR,
    _AllToAll,
    dropped_parameters,
    expert_groups,
    mark_expert,
    mark_expert_index,
)
from ds_core.zero.config.sections import ExpertParallelConfig
from ds_core.zero.partitioned_init import INIT_ATTR, restore_full

__all__ = [
    "ExpertParallelMoE",
    "MoEBlockSpec",
    "apply_autoep",
    "autoep_model_init",
    "find_moe_blocks",
    "model_ep_size",
]

log = logging.getLogger("ds_core.autoep")

_ROUTERS = ("gate", "router")
_SHARED = ("shared_expert", "shared_experts")
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok")
#: attribute on the root module of a converted model: its EP size.
_MODEL_ATTR = "ds_autoep_size"


@dataclass(frozen=True)
class MoEBlockSpec:
    """A recognised MoE block: where it is and how it routes.

    :param path: full module path.
    :param router: child name of the router ``nn.Linear``.
    :param experts: child name of the experts' ``nn.ModuleList``.
    :param num_experts: experts in the block.
    :param top_k: experts per token.
    :param route_norm: whether the top-k weights are renormalised to sum to one.
    :param scale: product of ``route_scale`` and ``routed_scaling_factor``.
    :param shared: child name of the shared expert, or ``None``.
    :param shared_gate: child name of the shared expert's sigmoid gate, or ``None``.
    """

    path: str
    router: str
    experts: str
    num_experts: int
    top_k: int
    route_norm: bool
    scale: float
    shared: str | None
    shared_gate: str | None


class ExpertParallelMoE(nn.Module):
    """A top-k MoE layer whose experts are split over an EP group (see the module docstring).

    :param gate: the router, ``nn.Linear(hidden, num_experts)``; replicated.
    :param experts: this rank's ``num_experts / ep_size`` expert modules, in global order.
    :param spec: the routing of the block this replaces.
    :param ep_size: ranks the experts are split over.
    :param capacity_factor: ``None`` or 0 drops nothing; else the slots rule of the module
        docstring.
    :param shared_expert: applied to every token and added, when given.
    :param shared_expert_gate: ``nn.Linear(hidden, 1)``; its sigmoid scales the shared output.
    :param return_router_logits: return ``(output, router_logits)`` as the original did.
    :param tp_size: the tensor-parallel size of the mesh: EP groups join ranks of the same TP
        coordinate (:func:`ds_core.parallel.expert.moe.expert_groups`).
    """

    def __init__(
        self,
        gate: nn.Module,
        experts: list[nn.Module],
        spec: MoEBlockSpec,
        ep_size: int,
        capacity_factor: float | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        return_router_logits: bool = False,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        self.route_norm, self.scale = spec.route_norm, spec.scale
        self.ep_size = ep_size
        self.num_local = spec.num_experts // ep_size
        self.capacity_factor = capacity_factor or None
        self.return_router_logits = return_router_logits
        self.gate = gate
        self.experts = nn.ModuleList(experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        for j, expert in enumerate(self.experts):  # checkpoints key them by global expert
            mark_expert_index(expert, j, self.num_local)
        for p in self.experts.parameters():
            mark_expert(p, ep_size)

    def capacity(self, tokens: int) -> int:
        """Slots per expert for ``tokens`` tokens on this rank."""
        if self.capacity_factor is None:
            return tokens
        want = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        return min(tokens, max(1, want))

    def route(self, x_td: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(router_logits [T, E], weights [T, k], experts [T, k])`` for tokens ``x_td``."""
        logits = self.gate(x_td)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return logits, weights.to(x_td.dtype), chosen

    def slots(self, chosen: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot [k·T], kept [k·T])`` of each choice, choice-major (every first choice in
        token order, then every second one...): slot ``e·C + position in e's queue``, and
        whether that position is under the capacity ``C``."""
        flat = chosen.t().reshape(-1)
        onehot = F.one_hot(flat, self.num_experts)
        position = (onehot.cumsum(dim=0) - 1).gather(1, flat.unsqueeze(1)).squeeze(1)
        return flat * cap + position, position < cap

    def forward(self, x: torch.Tensor) -> Any:
        shape = x.shape
        x_td = x.reshape(-1, shape[-1])
        tokens, width = x_td.shape
        logits, weights, chosen = self.route(x_td)
        cap = self.capacity(tokens)
        slot, kept = self.slots(chosen, cap)
        token = torch.arange(tokens, device=x.device).repeat(self.top_k)[kept]
        slot, weight = slot[kept], weights.t().reshape(-1)[kept]
        dispatch = x_td.new_zeros(self.num_experts * cap, width).index_add(0, slot, x_td[token])
        out_sd = self._experts(dispatch.view(self.num_experts, cap, width)).view(-1, width)
        routed = x_td.new_zeros(tokens, width).index_add(
            0, token, out_sd.index_select(0, slot) * weight.unsqueeze(1)
        )
        if self.shared_expert is not None:
            shared = self.shared_expert(x_td)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x_td)) * shared
            routed = routed + shared
        out = routed.view(shape)
        return (out, logits) if self.return_router_logits else out

    def _experts(self, dispatch_ecd: torch.Tensor) -> torch.Tensor:
        """Run every expert on its slots ``[E, C, D]``, wherever the expert lives."""
        if self.ep_size == 1:
            return torch.stack([self.experts[e](dispatch_ecd[e]) for e in range(self.num_experts)])
        group = expert_groups(self.ep_size, self.tp_size).ep_group
        e, c, d = dispatch_ecd.shape
        # Chunk i of the result holds rank i's slots for this rank's local experts.
        recv: torch.Tensor = _AllToAll.apply(group, dispatch_ecd)  # type: ignore[no-untyped-call]
        recv_rlcd = recv.view(self.ep_size, self.num_local, c, d)
        outs = [
            self.experts[j](recv_rlcd[:, j].reshape(-1, d)).view(self.ep_size, c, d)
            for j in range(self.num_local)
        ]
        back = torch.stack(outs, dim=1).reshape(e, c, d)
        result: torch.Tensor = _AllToAll.apply(group, back)  # type: ignore[no-untyped-call]
        return result


# ------------------------------------------------------------------------------- detection


def _child(module: nn.Module, name: str | None, defaults: tuple[str, ...]) -> str | None:
    for candidate in (name,) if name else defaults:
        if candidate in module._modules and module._modules[candidate] is not None:
            return candidate
    return None


def _out_features(linear: nn.Linear) -> int:
    return int(linear.out_features)


def _spec(path: str, module: nn.Module, cfg: ExpertParallelConfig) -> MoEBlockSpec | str:
    """The block's spec, or why ``module`` is not a recognisable MoE block."""
    router = _child(module, cfg.router_pattern, _ROUTERS)
    experts = _child(module, cfg.expert_pattern, ("experts",))
    if router is None or not isinstance(module._modules[router], nn.Linear):
        return f"no router nn.Linear child named {cfg.router_pattern or ' or '.join(_ROUTERS)}"
    if experts is None or not isinstance(module._modules[experts], nn.ModuleList):
        return f"no nn.ModuleList child named {cfg.expert_pattern or 'experts'}"
    gate = module._modules[router]
    expert_list = module._modules[experts]
    assert isinstance(gate, nn.Linear) and isinstance(expert_list, nn.ModuleList)
    n = len(expert_list)
    if _out_features(gate) != n:
        return f"router {router} has {_out_features(gate)} outputs for {n} experts"
    if cfg.num_experts_attr is not None and getattr(module, cfg.num_experts_attr, n) != n:
        return f"{cfg.num_experts_attr} = {getattr(module, cfg.num_experts_attr)} but {n} experts"
    for field in ("expert_w1", "expert_w2", "expert_w3"):
        want = getattr(cfg, field)
        if want is not None and not all(hasattr(e, want) for e in expert_list):
            return f"expert_{field[-2:]} = {want!r}: not an attribute of every expert"
    if cfg.top_k != "auto":
        top_k = int(cfg.top_k)
    else:
        attrs = (cfg.top_k_attr,) if cfg.top_k_attr else _TOP_K_ATTRS
        top_k = next((int(getattr(module, a)) for a in attrs if hasattr(module, a)), 1)
    if not 1 <= top_k <= n:
        return f"top_k {top_k} is not between 1 and the {n} experts"
    if cfg.route_norm is not None:
        route_norm = bool(cfg.route_norm)
    elif cfg.preset_model == "mixtral" or path.rsplit(".", 1)[-1] == "block_sparse_moe":
        route_norm = True  # Mixtral renormalises its top-k weights
    else:
        route_norm = bool(getattr(module, "norm_topk_prob", False))
    factor = cfg.routed_scaling_factor
    if factor == "auto":
        factor = float(getattr(module, "routed_scaling_factor", 1.0))
    shared = None
    if cfg.has_shared_experts is not False:
        shared = _child(module, cfg.shared_experts_pattern, _SHARED)
        if cfg.has_shared_experts and shared is None:
            return "has_shared_experts is true but it has no shared expert child"
    shared_gate = None
    if shared is not None and isinstance(module._modules.get(f"{shared}_gate"), nn.Linear):
        shared_gate = f"{shared}_gate"
    return MoEBlockSpec(
        path, router, experts, n, top_k, route_norm, cfg.route_scale * float(factor),
        shared, shared_gate,
    )  # fmt: skip


def find_moe_blocks(model: nn.Module, cfg: ExpertParallelConfig) -> list[MoEBlockSpec]:
    """The MoE blocks of ``model`` that AutoEP converts (outermost first, none nested).

    :raises ConfigError: ``moe_layer_pattern`` matches no module, or matches one that is not
        a recognisable block (named, with the reason).
    """
    pattern = re.compile(cfg.moe_layer_pattern) if cfg.moe_layer_pattern else None
    found: list[MoEBlockSpec] = []
    matched = False
    for path, module in model.named_modules():
        if any(path.startswith(f"{b.path}.") for b in found) or isinstance(
            module, ExpertParallelMoE
        ):
            continue
        if pattern is not None:
            if not pattern.fullmatch(path):
                continue
            matched = True
            spec = _spec(path, module, cfg)
            if isinstance(spec, str):
                raise ConfigError(
                    f"expert_parallel.moe_layer_pattern matches '{path}' "
                    f"({type(module).__name__}), which AutoEP cannot convert: {spec}; narrow "
                    "the pattern, or set router_pattern / expert_pattern to its child names"
                )
            found.append(spec)
        elif isinstance(module, nn.Module):
            spec = _spec(path, module, cfg)
            if not isinstance(spec, str):
                found.append(spec)
    if pattern is not None and not matched:
        raise ConfigError(
            f"expert_parallel.moe_layer_pattern {cfg.moe_layer_pattern!r} matches no module "
            "(it is matched with re.fullmatch against full paths such as 'model.layers.0.mlp')"
        )
    return found


# ------------------------------------------------------------------------------ conversion


def _take_from_rank0(params: Iterator[nn.Parameter], keep: bool) -> None:
    """Give the expert rank 0's values (every rank builds the model, rank 0's values win, as
    for dense parameters) and drop it when another rank keeps it. Collective over the world:
    zero.Init shards are rebuilt (they were broadcast from rank 0 when cut), others broadcast
    from rank 0, one parameter at a time."""
    world = comm.get_world_size()
    for p in params:
        if hasattr(p, INIT_ATTR):
            restore_full(p, get_accelerator().device(), None)
        elif world > 1:
            with torch.no_grad():
                full = p.data.to(get_accelerator().device())
                get_accelerator().broadcast(full, 0, None)
                p.data = full.to(p.device)
        if not keep:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _returns_tuple(module: nn.Module, width: int) -> bool:
    if any(hasattr(p, INIT_ATTR) for p in module.parameters()):
        # Placeholders cannot run; Hugging Face's sparse MoE blocks return (out, logits).
        return type(module).__name__.endswith("SparseMoeBlock")
    p = next(module.parameters())
    with torch.no_grad():
        out = module(torch.zeros(1, 1, width, dtype=p.dtype, device=p.device))  # (B, T, D)
    return isinstance(out, tuple)


def apply_autoep(
    model: nn.Module, cfg: ExpertParallelConfig | dict[str, Any], tp_size: int = 1
) -> list[str]:
    """Replace ``model``'s MoE blocks by :class:`ExpertParallelMoE` layers, in place.

    ``tp_size`` is the tensor-parallel size the engine will apply (AutoTP then leaves the
    experts whole); the EP groups run along the data-parallel dimension. Collective when ``autoep_size`` > 1 (creates the expert groups) or the model was built
    under ``zero.Init``. Returns the converted paths.

    :raises ConfigError: as :func:`find_moe_blocks`; also when no block is found, when
        ``autoep_size`` does not divide the data-parallel size, or when a block's expert
        count is not divisible by it (each naming the module and the fix).
    """
    if isinstance(cfg, dict):
        cfg = ExpertParallelConfig.model_validate(cfg)
    ep = cfg.autoep_size
    tp = max(int(getattr(model, "ds_autotp_size", 1)), tp_size, 1)
    dp = comm.get_world_size() // tp
    if dp % ep:
        raise ConfigError(
            f"expert_parallel.autoep_size: {ep} does not divide the data-parallel size {dp} "
            f"(world {comm.get_world_size()} / tensor-parallel {tp}); choose a divisor of it"
        )
    specs = find_moe_blocks(model, cfg)
    if not specs:
        raise ConfigError(
            "expert_parallel.enabled: no MoE block found (a module with a router nn.Linear "
            "child 'gate'/'router' and an nn.ModuleList 'experts' of as many experts); set "
            "moe_layer_pattern / router_pattern / expert_pattern to name yours"
        )
    for spec in specs:
        if spec.num_experts % ep:
            raise ConfigError(
                f"{spec.path}: {spec.num_experts} experts are not divisible by "
                f"expert_parallel.autoep_size {ep}; choose an autoep_size dividing "
                f"{spec.num_experts}"
            )
    ep_rank = expert_groups(ep, tp).ep_rank if ep > 1 else 0
    dropped: set[int] = dropped_parameters(model)
    for spec in specs:
        block = model.get_submodule(spec.path)
        experts = block._modules[spec.experts]
        assert isinstance(experts, nn.ModuleList)
        gate = block._modules[spec.router]
        assert gate is not None
        width = int(gate.in_features)  # type: ignore[arg-type]
        as_tuple = _returns_tuple(block, width)
        n_local = spec.num_experts // ep
        local = range(ep_rank * n_local, (ep_rank + 1) * n_local)
        for i, expert in enumerate(experts):
            _take_from_rank0(expert.parameters(), keep=i in local)
            if i not in local:
                dropped.update(id(p) for p in expert.parameters())
        layer = ExpertParallelMoE(
            gate,
            [experts[i] for i in local],
            spec,
            ep,
            cfg.capacity_factor,
            block._modules[spec.shared] if spec.shared else None,
            block._modules[spec.shared_gate] if spec.shared_gate else None,
            as_tuple,
            tp,
        )
        parent_path, _, name = spec.path.rpartition(".")
        if spec.path == "":
            raise ConfigError("expert_parallel: the root module itself is an MoE block; wrap it")
        setattr(model.get_submodule(parent_path), name, layer)
    setattr(model, _MODEL_ATTR, ep)
    setattr(model, DROPPED_ATTR, dropped)
    log.info("AutoEP (ep=%d): converted %s", ep, ", ".join(s.path for s in specs))
    return [s.path for s in specs]


def autoep_model_init(model: nn.Module, ep_size: int, **keys: Any) -> nn.Module:
    """Function form of AutoEP: :func:`apply_autoep` with ``autoep_size = ep_size`` and any
    other ``expert_parallel`` keys; returns ``model``. ``initialize()`` then needs no
    ``expert_parallel`` section (the experts are already marked)."""
    apply_autoep(model, ExpertParallelConfig(enabled=True, autoep_size=ep_size, **keys))
    return model


def model_ep_size(model: nn.Module) -> int:
    """The EP size a model was converted with (1 if never)."""
    return int(getattr(model, _MODEL_ATTR, 1))

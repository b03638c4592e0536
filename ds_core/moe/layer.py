"""``deepspeed.moe.layer.MoE``: DeepSpeed's constructor and return value over ds_core's MoE.

The layer is :class:`ds_core.parallel.expert.moe.MoE` (top-1 gate, experts split over
``ep_size`` ranks) with the experts DeepSpeed's caller passes: ``expert`` is copied once per
local expert. ``forward`` returns DeepSpeed's ``(output, l_aux, exp_counts)``.

Differences, each refused where it would change a result: only ``k=1`` (top-1); no token is
dropped, so the output is DeepSpeed's with ``drop_tokens=False`` (``capacity_factor``,
``eval_capacity_factor``, ``min_capacity`` and ``use_rts`` only matter when tokens are dropped,
and are accepted); ``use_residual``, ``noisy_gate_policy``, ``use_tutel`` and
``enable_expert_tensor_parallelism`` are refused unless off.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from ds_core.errors import ConfigError
from ds_core.parallel.expert.moe import MoE as _MoE
from ds_core.parallel.expert.moe import expert_groups, mark_expert, mark_expert_index

__all__ = ["MoE"]


class MoE(_MoE):
    """A mixture-of-experts layer with ``deepspeed.moe.layer.MoE``'s arguments (module docstring).

    :param hidden_size: the layer's input and output width.
    :param expert: one expert; ``num_experts / ep_size`` deep copies are made on each rank.
    :param num_experts: experts in the layer, a multiple of ``ep_size``.
    :param ep_size: ranks the experts are split over.
    :raises ConfigError: for ``k`` other than 1 or an option ds_core does not implement.
    :raises ValueError: when ``num_experts`` is not a multiple of ``ep_size``.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        refused = {
            "k": (k, 1),
            "use_residual": (use_residual, False),
            "noisy_gate_policy": (None if noisy_gate_policy == "None" else noisy_gate_policy, None),
            "use_tutel": (use_tutel, False),
            "enable_expert_tensor_parallelism": (enable_expert_tensor_parallelism, False),
        }
        for name, (value, supported) in refused.items():
            if value != supported:
                raise ConfigError(
                    f"MoE({name}={value!r}) is not supported by ds_core (only {supported!r}); "
                    "ds_core's MoE is top-1 without residual, noise, Tutel or expert tensor "
                    "parallelism"
                )
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of ep_size ({ep_size})"
            )
        nn.Module.__init__(self)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local = self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.drop_tokens = drop_tokens
        self.ep_rank = expert_groups(ep_size).ep_rank if ep_size > 1 else 0
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(self.num_local))
        for j, local in enumerate(self.experts):
            mark_expert_index(local, j, self.num_local)
        for p in self.experts.parameters():
            mark_expert(p, ep_size)
            # DeepSpeed's marks, read by code written for it (and by ds_core.moe.utils)
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = self.expert_group_name  # type: ignore[attr-defined]

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)``: the layer's output, the load-balancing loss and the
        tokens routed to each expert (on the host), as DeepSpeed's top-1 gate computes them.

        :raises ConfigError: when ``used_token`` is given.
        """
        if used_token is not None:
            raise ConfigError("MoE.forward(used_token=...) is not supported by ds_core")
        output = super().forward(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        gates = F.softmax(self.gate(tokens), dim=-1)
        mask = F.one_hot(gates.argmax(dim=-1), self.num_experts)
        exp_counts = mask.sum(dim=0).detach().to("cpu")
        l_aux = (gates.mean(dim=0) * mask.float().mean(dim=0)).sum() * self.num_experts
        return output, l_aux, exp_counts

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, ep_size={self.ep_size}, k=1"

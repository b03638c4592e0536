"""``zero_optimization.leaf_module``: which modules stage 3 gathers whole (ds_core/zero/stage3.py).

The numerics of stage 3 with leaf modules are checked against single-process PyTorch in
test_zero_stages.py (scenarios ``s3_leaf``, ``s3_leaf_root``); this file checks the choice of
leaves and the errors, without ranks.
"""

from __future__ import annotations

import pytest
from torch import nn

from ds_core.errors import ConfigError
from ds_core.zero.config.sections import LeafModuleConfig
from ds_core.zero.stage3 import hooked_parameters, leaf_modules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)


def test_leaves_by_class_name_and_suffix_outermost_wins() -> None:
    net = Net()
    qualified = f"{Block.__module__}.{Block.__qualname__}"
    for cfg in ({"classes": ["Block"]}, {"classes": qualified}, {"name_suffixes": ["s.0", "s.1"]}):
        leaves = leaf_modules(net, LeafModuleConfig(**cfg))  # type: ignore[arg-type]
        assert leaves == set(net.blocks), cfg
    # a block and a module inside it: the block is the leaf
    both = LeafModuleConfig(classes=["Block"], names=["blocks.0.mlp"])
    assert leaf_modules(net, both) == set(net.blocks)
    assert leaf_modules(net, LeafModuleConfig(names=[""])) == {net}
    assert leaf_modules(net, LeafModuleConfig()) == set()


def test_hooked_parameters_give_a_leaf_its_subtree() -> None:
    net = Net()
    hooked = dict(hooked_parameters(net, {net.blocks[0]}))
    assert [id(p) for p in hooked[net.blocks[0]]] == [id(p) for p in net.blocks[0].parameters()]
    for inner in list(net.blocks[0].modules())[1:]:
        assert inner not in hooked  # no hooks inside a leaf
    assert [id(p) for p in hooked[net.blocks[1].ln]] == [
        id(p) for p in net.blocks[1].ln.parameters()
    ]
    assert hooked[net.blocks[1]] == []  # not a leaf: only its direct (no) parameters


@pytest.mark.parametrize(
    ("cfg", "field"),
    [({"classes": ["Blok"]}, "classes"), ({"names": ["blocks.9"]}, "names"),
     ({"name_suffixes": [".attn"]}, "name_suffixes")],
)  # fmt: skip
def test_an_entry_that_matches_nothing_is_refused_by_name(
    cfg: dict[str, list[str]], field: str
) -> None:
    with pytest.raises(ConfigError, match=f"leaf_module.{field}: .* matches no module"):
        leaf_modules(Net(), LeafModuleConfig(**cfg))  # type: ignore[arg-type]


def test_leaf_module_loads_from_a_deepspeed_config() -> None:
    from ds_core.zero.config import load_config

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "leaf_module": {"classes": "Block"}},
    }
    assert load_config(cfg, 1).zero_optimization.leaf_module.classes == ["Block"]
    with pytest.raises(Exception, match="leaf_module"):
        load_config(
            {**cfg, "zero_optimization": {"stage": 3, "leaf_module": {"class": ["Block"]}}}, 1
        )

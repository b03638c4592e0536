"""AutoTP with ZeRO: TP=2 × DP=2 (4 gloo ranks) at stages 0-3 and TP=2 alone (2 ranks) equal
single-process PyTorch on the global batch; the partition config's full-path patterns take
effect and wrong ones are refused; the conversion's layout, checked in one process.

Each rank's final parameters are its TP shard; the reference's full parameter is cut the way
AutoTP cuts it (column: rows of each fused sub-parameter, row: columns) and compared per rank.
Tolerances as in test_zero_stages.py (fp32, 1e-5 relative; AdamW eps 1e-6, see _common.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ds_core.comm.mesh import Mesh
from ds_core.errors import ConfigError
from ds_core.tp import LinearColumnParallel, LinearRowParallel, apply_autotp, plan_autotp
from tests.zero import _autotp as A  # noqa: N812
from tests.zero.conftest import SuiteResults

RTOL, ATOL = 1e-5, 1e-6
SCENARIOS = [(4, n) for n in A.scenarios(4)] + [(2, n) for n in A.scenarios(2)]


def _expected_shard(full: torch.Tensor, kind: str | None, fused: int, tp: int, r: int) -> Any:
    if kind == "column":
        sub = full.reshape(fused, full.shape[0] // fused, *full.shape[1:])
        return sub.chunk(tp, dim=1)[r].reshape(-1, *full.shape[1:])
    if kind == "row":
        return full.chunk(tp, dim=1)[r]
    return full


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), SCENARIOS, ids=[f"w{w}-{n}" for w, n in SCENARIOS])
def test_autotp_matches_single_process_reference(
    suite: Callable[[str, int], SuiteResults], world: int, name: str
) -> None:
    sc = A.scenarios(world)[name]
    ranks = suite("autotp", world).ranks(name)
    ref = A.run_reference(sc)

    per_rank = torch.tensor([r["losses"] for r in ranks]).view(world, sc.steps, sc.gas)
    torch.testing.assert_close(
        per_rank.mean(dim=(0, 2)), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL
    )
    for r in ranks:  # one global norm on every rank: each TP shard once, replicas once
        torch.testing.assert_close(
            torch.tensor(r["norms"], dtype=torch.float64),
            torch.tensor(ref["norms"], dtype=torch.float64),
            rtol=RTOL,
            atol=ATOL,
        )
        assert r["dp_size"] == sc.dp
        assert r["train_batch_size"] == A.MICRO * sc.gas * sc.dp

    split = [n for n, k in ranks[0]["kinds"].items() if k is not None]
    assert split, "AutoTP split nothing"
    for rank, res in enumerate(ranks):
        tp_rank = rank % sc.tp
        assert set(res["state"]) == set(ref["params"])
        for pname, value in ref["params"].items():
            kind = res["kinds"][pname]
            fused = 3 if pname.endswith("attn.qkv.weight") or pname.endswith("attn.qkv.bias") else 1
            want = _expected_shard(value.detach(), kind, fused, sc.tp, tp_rank)
            floor = max(ATOL, RTOL * float(value.detach().abs().max()))
            torch.testing.assert_close(
                res["state"][pname],
                want,
                rtol=RTOL,
                atol=floor,
                msg=lambda m, n=pname, r=rank: f"rank {r} {n}: {m}",
            )


@pytest.mark.slow
def test_layout_of_the_llama_model(suite: Callable[[str, int], SuiteResults]) -> None:
    res = suite("autotp", 4).ranks("tp2dp2_s1")[0]
    types, kinds = res["types"], res["kinds"]
    for i in range(A.LAYERS):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert types[f"model.layers.{i}.self_attn.{proj}"] == "LinearColumnParallel"
        assert types[f"model.layers.{i}.self_attn.o_proj"] == "LinearRowParallel"
        assert types[f"model.layers.{i}.mlp.gate_proj"] == "LinearColumnParallel"
        assert kinds[f"model.layers.{i}.mlp.up_proj.bias"] == "column"
        assert kinds[f"model.layers.{i}.mlp.down_proj.bias"] is None  # added once, replicated
    assert types["lm_head"] == "Linear" and kinds["model.embed_tokens.weight"] is None


@pytest.mark.slow
def test_partition_config_with_full_paths_takes_effect(
    suite: Callable[[str, int], SuiteResults],
) -> None:
    types = suite("autotp", 2).ranks("tp2_pcfg_s2")[0]["types"]
    assert types["model.layers.0.mlp.up_proj"] == "LinearColumnParallel"
    assert types["model.layers.0.mlp.down_proj"] == "LinearRowParallel"
    for proj in ("gate_proj", "up_proj", "down_proj"):  # skipped by its spec
        assert types[f"model.layers.1.mlp.{proj}"] == "Linear"
    assert types["model.layers.1.self_attn.q_proj"] == "LinearColumnParallel"  # defaults


@pytest.mark.slow
def test_wrong_partition_configs_are_refused(suite: Callable[[str, int], SuiteResults]) -> None:
    for res in suite("autotp", 2).ranks("refusals"):
        assert "match no module" in res["no_match"] and "layers" in res["no_match"]
        assert "model.embed_tokens" in res["embedding"] and "nn.Linear" in res["embedding"]
        assert "num_heads" in res["heads"] and "self_attn" in res["heads"]
        assert "universal=True" in res["checkpoint"]  # native TP saves: tests/checkpoint/test_tp.py


# --------------------------------------------------------------------------- in one process

FAKE = Mesh(tp_size=2, dp_size=1, tp_rank=1, dp_rank=0, tp_group=None, dp_group=None)


def test_heuristics_split_attention_and_mlp_and_adjust_heads() -> None:
    model = A.TinyLlama()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    done = apply_autotp(model, FAKE)
    assert done["model.layers.0.self_attn.q_proj"] == "column"
    assert done["model.layers.1.mlp.down_proj"] == "row"
    assert "lm_head" not in done
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_key_value_heads) == (A.HEADS // 2, A.KV_HEADS // 2)
    assert isinstance(attn.k_proj, LinearColumnParallel)
    assert isinstance(model.model.layers[0].mlp.down_proj, LinearRowParallel)
    torch.testing.assert_close(
        attn.q_proj.weight.detach(), full["model.layers.0.self_attn.q_proj.weight"][8:]
    )
    down = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(
        down.weight.detach(), full["model.layers.0.mlp.down_proj.weight"][:, 16:]
    )
    torch.testing.assert_close(down.bias.detach(), full["model.layers.0.mlp.down_proj.bias"])


def test_gpt_example_fused_qkv_keeps_q_k_v_slices() -> None:
    model = A.gpt_model()
    qkv = model.blocks[0].attn.qkv.weight.detach().clone()  # type: ignore[union-attr,index]
    apply_autotp(model, FAKE)
    attn = model.blocks[0].attn  # type: ignore[index]
    assert attn.n_head == 1
    q, k, v = qkv.chunk(3)
    want = torch.cat([q[8:], k[8:], v[8:]])
    torch.testing.assert_close(attn.qkv.weight.detach(), want)
    assert isinstance(model.blocks[0].mlp.proj, LinearRowParallel)  # type: ignore[index]


def test_a_lone_projection_stays_replicated() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(4, 4))
    assert plan_autotp(model, 2) == {}


@pytest.mark.parametrize(
    ("layer_specs", "needle"),
    [
        ([{"patterns": [r"nothing\.here"]}], "match no module"),
        ([{"patterns": [r"model\.norm"], "partition_type": "column"}], "model.norm"),
    ],
)
def test_wrong_partition_configs_are_refused_in_one_process(
    layer_specs: list[dict[str, Any]], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        plan_autotp(A.TinyLlama(), 2, {"layer_specs": layer_specs})


def test_shape_not_divisible_names_the_module() -> None:
    model = A.TinyLlama()
    model.model.layers[0].mlp.gate_proj = nn.Linear(A.HIDDEN, 7, bias=False)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.gate_proj.*7"):
        apply_autotp(model, FAKE)


def test_strict_mode_names_undecided_linears() -> None:
    with pytest.raises(ConfigError, match="lm_head"):
        plan_autotp(A.TinyLlama(), 2, {"strict_mode": True})


def test_config_keys() -> None:
    from ds_core.zero.config import load_config

    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "tensor_parallel": {"autotp_size": 2, "partition_config": A.PARTITION_CONFIG},
        },
        4,
    )
    assert cfg.train_batch_size == 4  # 2 data-parallel replicas
    assert cfg.tensor_parallel.partition_config is not None
    with pytest.raises(ConfigError, match=r"tensor_parallel\.preset_model.*not supported yet"):
        load_config({"tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}, 2)
    with pytest.raises(ConfigError, match="does not divide"):
        load_config({"tensor_parallel": {"autotp_size": 3}}, 4)
    with pytest.raises(ConfigError, match="gather_output needs partition_type column"):
        load_config(
            {
                "tensor_parallel": {
                    "autotp_size": 2,
                    "partition_config": {
                        "layer_specs": [
                            {"patterns": ["x"], "partition_type": "row", "gather_output": True}
                        ]
                    },
                }
            },
            2,
        )
    with pytest.raises(ConfigError, match="partition_dim 1 with partition_type column"):
        load_config(
            {
                "tensor_parallel": {
                    "autotp_size": 2,
                    "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_dim": 1}]},
                }
            },
            2,
        )

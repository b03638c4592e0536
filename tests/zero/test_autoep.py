"""AutoEP with ZeRO: EP=2 on a 4-expert MoE model (2 gloo ranks, EP=2 × EDP=2 on 4, and
EP=2 inside TP=2 × DP=2 with AutoTP) at stages 0-3 equals single-process PyTorch on the global batch with a capacity that drops no
token; the expert gradients are the reference's, with and without AutoTP (checked directly
through an SGD step at lr 1); zero.Init-built models, a Qwen-MoE-style block with a shared expert and the function
form convert too; wrong configs are refused naming the module; the dropped-token rule at a
small capacity is checked in one process against its documented statement.

Each rank's parameters are its local experts (renamed to their global index) and the dense
parameters (TP shards compared with the reference cut as AutoTP cuts it). Tolerances as in test_zero_stages.py (fp32, 1e-5 relative; AdamW eps 1e-6).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from ds_core.errors import ConfigError
from ds_core.zero.autoep import ExpertParallelMoE, apply_autoep, find_moe_blocks
from ds_core.zero.config import load_config
from ds_core.zero.config.sections import ExpertParallelConfig
from tests.zero import _autoep as A  # noqa: N812
from tests.zero.conftest import SuiteGetter, SuiteResults
from tests.zero.test_autotp import _expected_shard

RTOL, ATOL = 1e-5, 1e-6
# Parameters of the 4-rank scenarios: AdamW amplifies rounding where a gradient is near zero
# (layer 1's input_layernorm.bias[6], magnitude 7e-4). Measured: 1.4e-6 absolute on cpu in
# this environment (the same at the commit before this wave's engine changes), 5.0e-6 on sim,
# whose kernels round differently; losses and norms stay within RTOL/ATOL.
FOUR_RANK_ATOL = 1e-5
SCENARIOS = [(4, n) for n in A.scenarios(4)] + [(2, n) for n in A.scenarios(2)]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), SCENARIOS, ids=[f"w{w}-{n}" for w, n in SCENARIOS])
def test_autoep_matches_single_process_reference(
    suite: SuiteGetter, backend: str, world: int, name: str
) -> None:
    sc = A.scenarios(world)[name]
    ranks = suite("autoep", world, backend).ranks(name)
    ref = A.run_reference(sc)

    per_rank = torch.tensor([r["losses"] for r in ranks]).view(world, sc.steps, sc.gas)
    torch.testing.assert_close(
        per_rank.mean(dim=(0, 2)), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL
    )
    held: set[str] = set()
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(res["norms"], dtype=torch.float64),
            torch.tensor(ref["norms"], dtype=torch.float64),
            rtol=RTOL,
            atol=ATOL,
        )
        ep_rank = (rank // sc.tp) % sc.ep
        local = range(ep_rank * A.EXPERTS // sc.ep, (ep_rank + 1) * A.EXPERTS // sc.ep)
        experts = {n for n in res["state"] if ".experts." in n}
        assert experts == set(res["experts"]) and experts
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in experts} == set(local)
        held |= experts
        for pname, value in res["state"].items():
            kind = res["kinds"][pname]
            assert kind is None or ".experts." not in pname  # AutoTP leaves experts whole
            want = _expected_shard(ref["params"][pname], kind, 1, sc.tp, rank % sc.tp)
            floor = max(
                ATOL if world == 2 else FOUR_RANK_ATOL,
                sc.param_atol,
                RTOL * float(want.abs().max()),
            )
            torch.testing.assert_close(
                value,
                want,
                rtol=RTOL,
                atol=floor,
                msg=lambda m, n=pname, r=rank: f"rank {r} {n}: {m}",
            )
        moe = "block_sparse_moe" if sc.kind == "mixtral" else "mlp"
        assert res["types"][f"model.layers.0.{moe}"] == "ExpertParallelMoE"
    assert held == {n for n in ref["params"] if ".experts." in n}  # every expert held somewhere


@pytest.mark.slow
def test_each_expert_gradient_is_the_reference_gradient(
    suite: Callable[[str, int], SuiteResults],
) -> None:
    """SGD at lr 1: a parameter's change is minus its reduced gradient. An expert's gradient
    sums the contributions of tokens from both ranks (through the all-to-all) over its
    expert-data-parallel group and is divided by the data-parallel size, so it must equal the
    single-process gradient of the mean loss: a missing or doubled scale fails here."""
    for world, name in ((2, "ep2_grad_s2"), (4, "tp2ep2_grad_s2")):
        _check_minus_grad(A.scenarios(world)[name], suite("autoep", world).ranks(name))


def _check_minus_grad(sc: A.EPScenario, ranks: list[dict[str, object]]) -> None:
    ref = A.run_reference(sc)
    for rank, res in enumerate(ranks):
        kinds: dict[str, str | None] = res["kinds"]  # type: ignore[assignment]
        assert any(k is not None for k in kinds.values()) == (sc.tp > 1)
        for pname, delta in res["minus_grad"].items():  # type: ignore[attr-defined]
            want = _expected_shard(-ref["grads"][pname], kinds[pname], 1, sc.tp, rank % sc.tp)
            assert float(want.abs().max()) > 0, pname
            # lr 1: the change carries the parameter's rounding (|values| up to ~3: ulp 2.4e-7)
            floor = max(ATOL, RTOL * float(want.abs().max()))
            torch.testing.assert_close(
                delta,
                want,
                rtol=RTOL,
                atol=floor,
                msg=lambda m, n=pname, r=rank: f"rank {r} {n}: {m}",
            )


@pytest.mark.slow
def test_wrong_configs_are_refused_naming_the_module(
    suite: Callable[[str, int], SuiteResults],
) -> None:
    for res in suite("autoep", 2).ranks("refusals"):
        assert "model.layers.1.block_sparse_moe" in res["indivisible"]
        assert "3 experts" in res["indivisible"] and "autoep_size" in res["indivisible"]
        assert "model.layers.0.dense" in res["not_a_block"]
        assert "moe_layer_pattern" in res["not_a_block"]
        assert "matches no module" in res["no_match"]
        assert "data-parallel size 2" in res["dp_world"] and "autoep_size" in res["dp_world"]


# --------------------------------------------------------------------------- in one process


def _layer(capacity_factor: float | None, top_k: int = 2) -> ExpertParallelMoE:
    model = A.build()
    cfg = ExpertParallelConfig(enabled=True, capacity_factor=capacity_factor, top_k=top_k)
    apply_autoep(model, cfg)
    layer = model.model.layers[0].block_sparse_moe
    assert isinstance(layer, ExpertParallelMoE)
    return layer


def _rule(layer: ExpertParallelMoE, x_td: torch.Tensor, cap: int) -> torch.Tensor:
    """The documented rule, written out token by token: slots go to every token's first
    choice in token order, then to second choices; a choice past its expert's ``cap`` slots
    adds nothing and the token's other weights are not renormalised."""
    _, weights, chosen = layer.route(x_td)
    used = [0] * layer.num_experts
    out = torch.zeros_like(x_td)
    for k in range(layer.top_k):
        for t in range(x_td.shape[0]):
            e = int(chosen[t, k])
            if used[e] < cap:
                used[e] += 1
                out[t] += weights[t, k] * layer.experts[e](x_td[t : t + 1])[0]
    return out


def test_small_capacity_drops_choices_by_the_documented_rule() -> None:
    torch.manual_seed(3)
    x = torch.randn(1, 24, A.HIDDEN)
    layer = _layer(capacity_factor=0.25)
    cap = math.ceil(0.25 * 24 * 2 / A.EXPERTS)
    assert layer.capacity(24) == cap == 3
    with torch.no_grad():
        got, _ = layer(x)
        want = _rule(layer, x[0], cap)
        dropless = _rule(layer, x[0], 24)
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want, dropless)  # the capacity did drop something
    zero_rows = (want.abs().sum(dim=1) == 0).sum()
    assert zero_rows > 0  # tokens with every choice dropped get a zero routed output


def test_no_capacity_equals_the_original_block() -> None:
    torch.manual_seed(4)
    x = torch.randn(2, 5, A.HIDDEN)
    original = A.build().model.layers[0].block_sparse_moe
    for factor in (None, 0.0):
        layer = _layer(capacity_factor=factor)
        assert layer.capacity(10) == 10
        with torch.no_grad():
            got, logits = layer(x)
            want, want_logits = original(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, want_logits)


def test_detection_of_the_common_shapes() -> None:
    cfg = ExpertParallelConfig(enabled=True)
    mixtral = find_moe_blocks(A.build("mixtral"), cfg)
    assert [s.path for s in mixtral] == [f"model.layers.{i}.block_sparse_moe" for i in range(2)]
    assert mixtral[0].route_norm and mixtral[0].top_k == 2 and mixtral[0].shared is None
    qwen = find_moe_blocks(A.build("qwen"), cfg)
    assert [s.path for s in qwen] == [f"model.layers.{i}.mlp" for i in range(2)]
    assert not qwen[0].route_norm
    assert (qwen[0].shared, qwen[0].shared_gate) == ("shared_expert", "shared_expert_gate")


def test_a_pattern_naming_a_non_block_is_refused_naming_it() -> None:
    # (an expert count not divisible by autoep_size needs 2 ranks: the refusals job)
    cfg = {"enabled": True, "moe_layer_pattern": r"model\.layers\.\d+\.dense"}
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.dense' \(DenseMLP\)"):
        apply_autoep(A.build(), cfg)
    only_one = {"enabled": True, "moe_layer_pattern": r"model\.layers\.1\.block_sparse_moe"}
    model = A.build()
    assert apply_autoep(model, only_one) == ["model.layers.1.block_sparse_moe"]
    assert type(model.model.layers[0].block_sparse_moe).__name__ == "MixtralSparseMoeBlock"


def test_config_keys() -> None:
    # use_grouped_mm selects a kernel, not a result: accepted and named as ignored
    with pytest.warns(UserWarning, match=r"ignores .*expert_parallel\.use_grouped_mm"):
        cfg = load_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "expert_parallel": {
                    "enabled": True,
                    "autoep_size": 2,
                    "preset_model": "mixtral",
                    "use_grouped_mm": True,
                    "top_k": 2,
                },
            },
            2,
        )
    assert cfg.expert_parallel.autoep_size == 2 and cfg.expert_parallel.top_k == 2
    for key, value in (
        ("preset_model", "deepseek_v3"),
        ("score_func", "sigmoid"),
        ("load_balance_coeff", 1e-3),
        ("num_expert_groups", 2),
    ):
        with pytest.raises(ConfigError, match=rf"expert_parallel\.{key}.*not supported yet"):
            load_config({"expert_parallel": {"enabled": True, key: value}}, 2)
    with pytest.raises(ConfigError, match=r"expert_parallel\.autoep_sise"):
        load_config({"expert_parallel": {"autoep_sise": 2}}, 2)

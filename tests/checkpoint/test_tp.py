"""Tensor-parallel checkpoints: a TP=2 universal checkpoint reloads at TP=2 and at TP=1.

Saved at TP=2 (2 ranks, stage 1) after 3 steps; the uninterrupted run trains 3 more. Reloads:
TP=2 stage 1 (same layout: bitwise equal to the uninterrupted run), TP=2 stage 3, TP=1 on 2
ranks (DP=2, stage 2) and on 1 rank (stage 0). The full (unsharded) masters and Adam moments
after every load equal the saved ones bitwise; continued training matches within fp32
tolerance (1e-5 relative). The checkpoint exports to the plain model's full weights. See
[Note: TP in checkpoints] in ds_core/checkpoint/_tp.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_core.checkpoint import _tp, consolidated_state_dict
from ds_core.checkpoint._reader import CheckpointReader
from ds_core.cli import main
from ds_core.comm.mesh import Mesh
from ds_core.parallel.tensor import TP_ATTR, TP_FUSED_ATTR, slice_rows
from tests.zero import _autotp as A  # noqa: N812

LOADS = [
    ("tp_save", "tp2_s1"),
    ("tp_save", "tp2_s3"),
    ("tp_save", "tp1_dp2_s2"),
    ("tp_w1", "tp1_s0"),
]


def global_losses(runs: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in runs], dtype=torch.float64).mean(0)


@pytest.mark.slow
@pytest.mark.parametrize(("suite_name", "job"), LOADS)
def test_full_state_after_load_equals_saved(suite: Any, suite_name: str, job: str) -> None:
    saved = suite("tp_save").ranks("save")[0]["saved"]
    assert set(saved) == {n for n, _ in A.TinyLlama().named_parameters()}
    for r, run in enumerate(suite(suite_name).ranks(job)):
        assert set(run["loaded"]) == set(saved)
        for name, values in saved.items():
            for k, v in values.items():
                assert torch.equal(run["loaded"][name][k], v), f"rank {r}: {name}.{k}"


@pytest.mark.slow
@pytest.mark.parametrize(("suite_name", "job"), LOADS)
def test_continued_training_matches_the_uninterrupted_run(
    suite: Any, suite_name: str, job: str
) -> None:
    refs = suite("tp_save").ranks("save")
    runs = suite(suite_name).ranks(job)
    bitwise = job == "tp2_s1"  # the layout it was saved from
    if bitwise:
        assert [r["losses"] for r in runs] == [r["losses"] for r in refs]
    torch.testing.assert_close(global_losses(runs), global_losses(refs), rtol=1e-5, atol=1e-6)
    for run in runs:
        assert run["steps"] == 6
        for name, values in refs[0]["final"].items():
            for k, v in values.items():
                if bitwise:
                    assert torch.equal(run["final"][name][k], v), f"{name}.{k}"
                else:
                    torch.testing.assert_close(
                        run["final"][name][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}.{k}"
                    )


@pytest.mark.slow
def test_fused_gqa_and_tied_vocab_parallel_checkpoint_reloads_at_tp1(suite: Any) -> None:
    ref = suite("tp_save").ranks("save_vocab")
    saved = ref[0]["saved"]
    # the tied weight once, under the embedding's name; qkv_proj / gate_up_proj whole
    assert set(saved) == {n for n, _ in A.TinyLlama(fused=True, tied=True).named_parameters()}
    qkv = saved["model.layers.0.self_attn.qkv_proj.weight"]["fp32"]
    assert qkv.shape == ((A.HEADS + 2 * A.KV_HEADS) * A.HIDDEN // A.HEADS, A.HIDDEN)
    runs = suite("tp_save").ranks("vocab_tp1_dp2_s2")
    for r, run in enumerate(runs):
        for name, values in saved.items():
            for k, v in values.items():
                assert torch.equal(run["loaded"][name][k], v), f"rank {r}: {name}.{k}"
    torch.testing.assert_close(global_losses(runs), global_losses(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_export_gives_the_plain_model_full_weights(suite: Any, tmp_path: Path) -> None:
    res = suite("tp_save")
    ck = res.ckroot / "tp" / "universal"
    saved = res.ranks("save")[0]["saved"]
    state = consolidated_state_dict(ck)
    model = A.TinyLlama()
    model.load_state_dict(state)  # strict: full, unsharded shapes under plain names
    for name, values in saved.items():
        assert torch.equal(state[name], values["fp32"]), name
    out = tmp_path / "llama.safetensors"
    assert main(["checkpoint", "export", str(ck), str(out)]) == 0
    from safetensors.torch import load_file

    A.TinyLlama().load_state_dict(load_file(out))
    reader = CheckpointReader(ck / "global_step3")
    assert reader.meta["tp_size"] == 2 and reader.format == "universal"
    q = reader.params["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [A.HIDDEN, A.HIDDEN] and q["tp"] == {"kind": "column", "fused": 1}
    assert reader.params["model.layers.0.mlp.down_proj.weight"]["tp"]["kind"] == "row"
    assert reader.params["model.layers.0.mlp.down_proj.bias"]["tp"] is None
    # save_16bit_model gathers the TP shards too
    w16 = torch.load(res.ckroot / "tp" / "w16" / "model.pt", weights_only=True)
    A.TinyLlama().load_state_dict(w16)


@pytest.mark.slow
def test_native_save_of_a_tp_engine_is_refused(suite: Any) -> None:
    for run in suite("tp_save").ranks("save"):
        assert "CheckpointError" in run["native"] and "universal=True" in run["native"]
    assert not (suite("tp_save").ckroot / "tp" / "native" / "latest").exists()


# --------------------------------------------------------------------------- in one process


class _FakeGather:
    """``all_gather`` of a TP group whose ranks hold ``shards`` (in rank order)."""

    def __init__(self, shards: list[torch.Tensor]) -> None:
        self.shards = shards

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
        out.copy_(torch.cat([s.reshape(-1) for s in self.shards]))
        return SimpleNamespace(wait=lambda: None)


@pytest.mark.parametrize(("kind", "fused", "shape"), [("column", 3, (12, 4)), ("column", 2, (8,)),
                                                      ("column", (8, 4, 4), (16, 2)),  # GQA
                                                      ("row", 1, (4, 6)), ("column", 1, (6, 2))])  # fmt: skip
def test_gather_and_cut_invert_autotp_split(
    kind: str, fused: int | tuple[int, ...], shape: tuple[int, ...]
) -> None:
    tp = 2
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    if kind == "row":
        shards = list(full.chunk(tp, dim=1))
    else:  # exactly as AutoTP cuts a (fused) column-parallel weight
        shards = [slice_rows(full, fused, tp, r) for r in range(tp)]
    for r in range(tp):
        param = torch.nn.Parameter(shards[r].clone())
        setattr(param, TP_ATTR, kind)
        setattr(param, TP_FUSED_ATTR, fused)
        zp = SimpleNamespace(param=param, shape=param.shape)
        mesh = Mesh(tp, 1, r, 0, None, None)
        engine: Any = SimpleNamespace(mesh=mesh, acc=_FakeGather(shards))
        assert _tp.full_shape(engine, zp) == full.shape
        assert torch.equal(_tp.gather(engine, zp, shards[r]), full)
        assert torch.equal(_tp.cut(engine, zp, full), shards[r])

"""Pipeline schedules, partitions and layer specs, on one process (no ranks, no backend).

The schedules and partitions must equal DeepSpeed 0.19.8's (runtime/pipe/schedule.py,
runtime/utils.py) where DeepSpeed is installed; the pairing property holds regardless.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ds_core.parallel.pipeline import schedule as sched
from ds_core.parallel.pipeline.module import LayerSpec, partition_balanced, partition_uniform


def _trace(schedule: sched.PipeSchedule) -> list[list[tuple[str, int]]]:
    return [[(type(c).__name__, getattr(c, "buffer_id", -1)) for c in cmds] for cmds in schedule]


@pytest.mark.parametrize("cls", [sched.TrainSchedule, sched.InferenceSchedule])
def test_schedules_pair_messages_step_by_step(cls: type[sched.PipeSchedule]) -> None:
    """In every step a stage's sends are exactly its neighbour's receives, and each stage
    runs each micro-batch's forward (and backward) once, the forward first."""
    pairs = {"SendActivation": ("RecvActivation", 1), "SendGrad": ("RecvGrad", -1)}
    for stages in range(1, 5):
        for mbs in range(1, 6):
            traces = [_trace(cls(mbs, stages, s)) for s in range(stages)]
            assert len({len(t) for t in traces}) == 1
            for step in range(len(traces[0])):
                for s in range(stages):
                    for name, _ in traces[s][step]:
                        if name in pairs:
                            want, delta = pairs[name]
                            peer = [n for n, _ in traces[s + delta][step]]
                            assert peer.count(want) == 1, (stages, mbs, s, step)
            for s in range(stages):
                flat = [n for cmds in traces[s] for n, _ in cmds]
                assert flat.count("ForwardPass") == mbs
                if cls is sched.TrainSchedule:
                    assert flat.count("BackwardPass") == mbs
                    assert flat[-1] == "OptimizerStep"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
def test_schedules_and_partitions_equal_deepspeed() -> None:
    """The same instructions, buffers and stage boundaries as DeepSpeed 0.19.8's."""
    from deepspeed.runtime.pipe import schedule as ds_sched
    from deepspeed.runtime.utils import partition_balanced as ds_bal
    from deepspeed.runtime.utils import partition_uniform as ds_uni

    for name in ("TrainSchedule", "InferenceSchedule"):
        mine, theirs = getattr(sched, name), getattr(ds_sched, name)
        for stages in range(1, 5):
            for mbs in range(1, 6):
                for s in range(stages):
                    got = _trace(mine(mbs, stages, s))
                    ref = theirs(micro_batches=mbs, stages=stages, stage_id=s)
                    assert got == _trace(ref), (name, stages, mbs, s)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (), generator=gen))
        m = int(torch.randint(1, 5, (), generator=gen))
        w = [int(v) for v in torch.randint(0, 4, (n,), generator=gen) ** 2]
        assert partition_balanced(w, m) == [int(v) for v in ds_bal(w, m)], (w, m)
        assert partition_uniform(n, m) == [int(v) for v in ds_uni(n, m)], (n, m)


def test_partitions() -> None:
    assert partition_uniform(5, 2) == [0, 3, 5]
    assert partition_uniform(2, 3) == [0, 1, 2, 2]
    # equal spreads: the later boundary wins, as in DeepSpeed
    assert partition_balanced([10, 0, 10, 0, 10, 10], 2) == [0, 4, 6]
    assert partition_balanced([1, 1, 1, 5], 2) == [0, 3, 4]


def test_layer_spec_refuses_non_module() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        LayerSpec(len)  # type: ignore[arg-type]
    assert repr(LayerSpec(nn.Linear, 2, 3, bias=False)) == "Linear(2, 3, bias=False)"

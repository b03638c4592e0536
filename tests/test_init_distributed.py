"""``init_distributed`` on an accelerator: device first, group bound to it, bad LOCAL_RANK refused.

Driven with a stand-in accelerator and a recording ``init_process_group`` (no process group is
created): the order of calls is what a device-only comm library (NCCL, HCCL) depends on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_core.comm import groups


class _Acc:
    name = "fakeacc"
    device_type = "fakeacc"

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def prepare_communication(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "fakeccl"

    def device_count(self) -> int:
        return 2

    def set_device(self, index: int) -> bool:
        self.calls.append(("set_device", index))
        return True

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("meta", index)

    def visible_devices_envs(self) -> list[str]:
        return ["FAKEACC_VISIBLE_DEVICES"]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    recorded: list[Any] = []
    monkeypatch.setattr(groups, "get_accelerator", lambda: _Acc(recorded))
    monkeypatch.setattr(groups.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        groups.dist, "init_process_group", lambda **kw: recorded.append(("init", kw))
    )
    monkeypatch.setattr(groups.atexit, "register", lambda fn: None)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29999")
    return recorded


def test_device_is_set_before_the_group_and_the_group_is_bound_to_it(
    calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    groups.init_distributed()
    assert calls[0] == ("set_device", 1)
    assert calls[1][0] == "init"
    assert calls[1][1]["device_id"] == torch.device("meta", 1)
    assert calls[1][1]["backend"] == "fakeccl"


def test_a_local_rank_beyond_the_visible_devices_is_refused_before_any_group(
    calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 .* 2 fakeacc device.*FAKEACC_VISIBLE"):
        groups.init_distributed()
    assert calls == []

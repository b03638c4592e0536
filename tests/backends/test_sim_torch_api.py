"""The sim device through torch's device-generic API (issue 27): its allocator is torch's
``c10::DeviceAllocator`` (``torch.accelerator``'s memory calls, ``Tensor.record_stream``), its
module answers ``get_amp_supported_dtype`` and simccl's work answers ``get_future``; the
frameworks in docs/interop.md call each of them."""

from __future__ import annotations

import pytest

from tests.backends.test_sim import MODES, run

pytest.importorskip("ds_backend_sim")


def test_torch_accelerator_memory_calls_reach_the_sim_allocator() -> None:
    r = run(
        """
        sim = device.init()
        x = torch.empty(1000, device="sim:1")  # 4000 B, rounded to 4096
        acc = torch.accelerator
        allocated = [acc.memory_allocated(1), sim.memory_allocated(1)]
        stats = acc.memory_stats(1)
        free, total = acc.get_memory_info(1)
        del x
        acc.empty_cache()
        out(allocated=allocated, peak=acc.max_memory_allocated(1),
            stats=[stats["allocated_bytes.all.current"], stats["allocation.all.current"]],
            info=[free, total, sim.mem_get_info(1)[1]], reserved=acc.memory_reserved(1),
            after=acc.memory_allocated(1))
        """
    )
    assert r["allocated"] == [4096, 4096]
    assert r["peak"] == 4096
    assert r["stats"] == [4096, 1]
    assert r["info"][1] == r["info"][2] and r["info"][0] <= r["info"][1] - 4096
    assert r["reserved"] == 0 and r["after"] == 0  # empty_cache released the block


def test_record_stream_holds_a_freed_block_until_the_stream_ran_its_work() -> None:
    # lazy mode: queued work runs only when waited for, so the side stream's copy is still
    # pending at the free
    r = run(
        """
        sim = device.init()
        side = sim.Stream()
        src = torch.ones(1024).pin_memory()
        seen = {}
        for recorded in (False, True):
            x = torch.empty(1024, device="sim")
            with sim.stream(side):
                x.copy_(src, non_blocking=True)  # queued on side, still pending
            if recorded:
                x.record_stream(side)
            del x
            seen[str(recorded)] = sim.memory_allocated()
            side.synchronize()
            torch.empty(1, device="sim")  # an allocation hands finished frees back
            seen[str(recorded) + "_after"] = sim.memory_allocated()
        try:
            torch.empty(4, device="sim").record_stream(torch.Stream(device="cpu"))
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        out(refused=refused, **seen)
        """,
        "lazy",
    )
    assert r["False"] == 0  # not recorded: back to the cache at once
    assert r["True"] == 4096  # recorded: held while the side stream's copy is pending
    assert r["True_after"] == 0  # the temporary (512 B) died too
    assert "takes a sim stream" in r["refused"]


def test_a_freed_block_goes_back_to_the_pool_of_the_stream_it_was_allocated_on() -> None:
    """A block freed while its stream still has work queued on it is handed only to later
    allocations on that stream (ordered after that work), as CUDA's caching allocator pools
    per stream: another stream's allocation gets fresh memory and cannot overwrite it first."""
    # lazy mode: queued work runs only when waited for, so the side stream's copy out of
    # the block is still pending when the block is freed and the default stream allocates
    r = run(
        """
        sim = device.init()
        side = sim.Stream()
        host = torch.zeros(1024).pin_memory()
        with sim.stream(side):
            x = torch.full((1024,), 1.0, device="sim")
            host.copy_(x, non_blocking=True)  # queued on side, still pending
            del x
        reserved = sim.memory_reserved()
        y = torch.full((1024,), 2.0, device="sim")  # the default stream: not x's block
        other = sim.memory_reserved() - reserved
        side.synchronize()
        copied = host.tolist()
        with sim.stream(side):
            z = torch.empty(1024, device="sim")  # the side stream: x's block again
        same = sim.memory_reserved() - reserved - other
        out(copied=sorted(set(copied)), other=other, same=same, y=sorted(set(y.tolist())))
        """,
        "lazy",
    )
    assert r["copied"] == [1.0]  # the queued copy read x's values, not the later fill's
    assert r["y"] == [2.0]
    assert r["other"] == 4096  # a fresh block for the default stream
    assert r["same"] == 0  # the side stream reused its own


@pytest.mark.parametrize("mode", MODES)
def test_autocast_contexts_open_and_torch_disables_an_enabled_one(mode: str) -> None:
    r = run(
        """
        import warnings
        sim = device.init()
        a = torch.ones(2, 2, device="sim")
        with torch.autocast(device_type="sim", enabled=False):
            off = str((a @ a).dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type="sim", dtype=torch.bfloat16):
                on = str((a @ a).dtype)
        out(dtypes=[str(d) for d in torch.sim.get_amp_supported_dtype()], off=off, on=on,
            warned=any("not supported" in str(w.message) for w in caught))
        """,
        mode,
    )
    assert r["dtypes"] == [] and r["off"] == r["on"] == "torch.float32" and r["warned"]


@pytest.mark.parametrize("mode", MODES)
def test_convolutions_run_their_host_kernels_forward_and_backward(mode: str) -> None:
    """torch sends convolutions on a device other than CPU/CUDA to operators it only declares
    (``convolution_overrideable``): sim registers ``convolution`` and ``convolution_backward``
    with its host fallback, so they equal the host's bit for bit (the CIFAR-style loop of
    tests/compat/_loops.py trains a Conv2d on sim)."""
    r = run(
        """
        sim = device.init()
        diffs = {}
        for name, make in {
            "conv2d": lambda: torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
            "conv_transpose2d": lambda: torch.nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2),
            "conv1d_no_bias": lambda: torch.nn.Conv1d(4, 6, 3, bias=False),
        }.items():
            torch.manual_seed(0)
            host, dev = make(), make()
            dev.load_state_dict(host.state_dict())
            dev.to("sim")
            shape = (2, 4, 9) if name.startswith("conv1d") else (2, 4, 9, 9)
            x = torch.randn(*shape, requires_grad=True)
            xd = x.detach().to("sim").requires_grad_()
            y, yd = host(x), dev(xd)
            y.pow(2).sum().backward()
            yd.pow(2).sum().backward()
            pairs = [(yd, y), (xd.grad, x.grad)] + [
                (a.grad, b.grad) for a, b in zip(dev.parameters(), host.parameters())
            ]
            diffs[name] = [str(yd.device)] + [
                bool(torch.equal(a.cpu(), b)) for a, b in pairs
            ]
        out(**diffs)
        """,
        mode,
    )
    for name, (dev, *equal) in r.items():
        assert dev == "sim:0" and all(equal), (name, equal)


@pytest.mark.parametrize("mode", MODES)
def test_reducing_losses_equal_the_hosts_and_warn_nothing(mode: str) -> None:
    """Losses on sim equal the host's bit for bit, forward and backward, without a warning:
    ``mse_loss`` and ``smooth_l1_loss`` are structured operators whose host ``.out`` kernel
    resized the functional form's 0-dim result (a deprecated resize torch warns about) until
    sim registered their functional forms with its host fallback."""
    r = run(
        """
        import warnings
        F = torch.nn.functional
        sim = device.init()
        torch.manual_seed(0)
        x, y = torch.randn(16, 4), torch.randn(16, 4)
        t, p = torch.randint(0, 4, (16,)), torch.rand(16, 4)
        losses = {
            "mse_loss": lambda x, d: F.mse_loss(x, y.to(d)),
            "mse_loss_sum": lambda x, d: F.mse_loss(x, y.to(d), reduction="sum"),
            "smooth_l1_loss": lambda x, d: F.smooth_l1_loss(x, y.to(d)),
            "huber_loss": lambda x, d: F.huber_loss(x, y.to(d)),
            "l1_loss": lambda x, d: F.l1_loss(x, y.to(d)),
            "cross_entropy": lambda x, d: F.cross_entropy(x, t.to(d)),
            "bce_with_logits": lambda x, d: F.binary_cross_entropy_with_logits(x, p.to(d)),
        }
        equal = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, loss in losses.items():
                xh, xd = x.clone().requires_grad_(), x.to("sim").requires_grad_()
                lh, ld = loss(xh, "cpu"), loss(xd, "sim")
                lh.backward()
                ld.backward()
                equal[name] = [torch.equal(ld.cpu(), lh), torch.equal(xd.grad.cpu(), xh.grad)]
        out(equal=equal, warnings=[str(w.message)[:80] for w in caught])
        """,
        mode,
    )
    assert r["warnings"] == []
    for name, both in r["equal"].items():
        assert both == [True, True], name


@pytest.mark.parametrize("mode", MODES)
def test_exiting_right_after_a_backward_on_sim_does_not_abort(mode: str) -> None:
    """Autograd's device thread drops its graph task (Python objects inside) after backward
    returns; a main thread that keeps the GIL until exit left it to finalization, which ends
    it with ``pthread_exit`` through C++ frames: "terminate called without an active
    exception", rc -6, in 6 of 8 runs without ds_core's exit handler
    (:func:`ds_core.backend_kit.yield_gil_at_exit`). Two runs, each must exit cleanly."""
    for _ in range(2):
        r = run(
            """
            device.init()
            m = torch.nn.Linear(4, 4).to("sim")
            out(ok=True)
            sys.setswitchinterval(10.0)  # the main thread keeps the GIL until it exits
            m(torch.randn(2, 4, device="sim")).sum().backward()
            """,
            mode,
        )
        assert r == {"ok": True}

"""Deliberately broken backends: each reuses the CPU backend and breaks one contract.

Each ``<name>.py`` here is the body of a backend module; :func:`install` writes it, with an
identity and a real ``dist-info`` (via ``tests.distfactory``), into a directory that a
subprocess puts on ``PYTHONPATH``, so ``importlib.metadata`` discovers it like a wheel.
:data:`BROKEN` maps each to the one conformance category that must catch it; CI runs each
only on that category.
"""

from __future__ import annotations

from pathlib import Path

from ds_core.hookspecs import HOOKSPEC_VERSION
from tests.distfactory import make_backend

HERE = Path(__file__).parent

#: backend file stem -> (category that must fail, a test that must fail there, what is broken)
BROKEN: dict[str, tuple[str, str, str]] = {
    "memory_frozen": (
        "memory",
        "test_allocated_grows_with_a_tensor_and_falls_when_freed",
        "memory_allocated never changes",
    ),
    "event_negative": (
        "stream",
        "test_elapsed_time_is_non_negative_and_monotone",
        "elapsed_time reports negative milliseconds",
    ),
    "reduce_scatter_wrong_shard": (
        "comm",
        "test_reduce_scatter[sum-float32-w2]",
        "reduce-scatter returns the next rank's shard",
    ),
    "probe_touches_device": (
        "hygiene",
        "test_probe_creates_no_device_context",
        "the probe initialises a (fake) vendor runtime it does not declare",
    ),
    "graph_replay_stale": (
        "graph",
        "test_replay_reads_the_new_static_input",
        "graph replay ignores new inputs",
    ),
    "graph_list_result_misindexed": (
        "graph",
        "test_replay_of_an_op_returning_a_list_of_tensors_equals_eager",
        "capture indexes a list result's aliasing past the schema's returns",
    ),
    "rng_restore_noop": (
        "rng",
        "test_state_save_and_restore_gives_identical_draws",
        "set_rng_state does nothing",
    ),
    "rng_set_state_accepts_malformed": (
        "rng",
        "test_set_state_refuses_a_state_of_another_shape",
        "set_rng_state swallows a malformed state instead of raising RuntimeError",
    ),
    "device_set_error_without_count": (
        "device",
        "test_set_out_of_range_raises_value_error",
        "set_device's out-of-range error does not name the device count",
    ),
    "profiler_push_returns_false": (
        "profiler",
        "test_ranges_nest_and_an_unmatched_pop_raises",
        "range_push opens a range but returns False",
    ),
    "rng_seed_returns_false": (
        "rng",
        "test_seed_reproduces_draws",
        "manual_seed seeds but returns False",
    ),
    "determinism_restore_returns_false": (
        "determinism",
        "test_record_names_what_was_set_and_restore_undoes_it",
        "restore undoes every setting but returns False",
    ),
    "memory_info_kib": (
        "memory",
        "test_values_follow_an_imposed_process_limit[RLIMIT_AS-VmSize]",
        "memory_info in KiB instead of bytes",
    ),
    "memory_ignores_rlimit_data": (
        "memory",
        "test_values_follow_an_imposed_process_limit[RLIMIT_DATA-VmData]",
        "a limit source (RLIMIT_DATA) ignored",
    ),
    "memory_ignores_cgroup_v2": (
        "memory",
        "test_values_follow_an_imposed_cgroup_limit[cgroup-v2-limited]",
        "a limit source (cgroup v2 memory.max) ignored",
    ),
    "memory_ignores_cgroup_v1": (
        "memory",
        "test_values_follow_an_imposed_cgroup_limit[cgroup-v1-limited]",
        "a limit source (cgroup v1 memory.limit_in_bytes) ignored",
    ),
    "memory_ignores_parent_cgroup": (
        "memory",
        "test_values_follow_an_imposed_cgroup_limit[cgroup-v2-parent-limited]",
        "a parent cgroup's limit ignored (only the process's own folder read)",
    ),
    "memory_available_ignores_usage": (
        "memory",
        "test_values_follow_an_imposed_process_limit[RLIMIT_AS-VmSize]",
        "available = the whole limit, ignoring the process's usage",
    ),
    "all_reduce_avg_is_sum": (
        "comm",
        "test_all_reduce[avg-float32-w2]",
        "all-reduce avg silently replaced by sum",
    ),
    "reduce_scatter_op_ignored": (
        "comm",
        "test_reduce_scatter[max-int32-w2]",
        "reduce-scatter sums whatever op it is given",
    ),
    "float64_via_float32": (
        "comm",
        "test_all_reduce[sum-float64-w2]",
        "float64 all-reduce carried through float32",
    ),
    "bf16_via_fp16": (
        "comm",
        "test_all_reduce[sum-bfloat16-w2]",
        "bfloat16 all-reduce carried through float16",
    ),
    "barrier_noop": (
        "comm",
        "test_barrier[late-sync-w2]",
        "barrier does not block",
    ),
    "sync_returns_early": (
        "comm",
        "test_all_reduce[sum-float32-late-sync-w2]",
        "a synchronous all-reduce returns before completing",
    ),
    "async_wait_noop": (
        "comm",
        "test_all_reduce[sum-float32-async-late-async-w2]",
        "an asynchronous all-reduce's wait() does not wait",
    ),
    "reduce_scatter_global_rank": (
        "comm",
        "test_reduce_scatter[avg-float32-group-w4]",
        "reduce-scatter chunk chosen by global rank, not group rank",
    ),
    "stream_use_restores_default": (
        "stream",
        "test_stream_contexts_nest_and_restore_exactly_the_previous_stream",
        "a stream context restores the default stream, not the previous one",
    ),
    "stream_context_global": (
        "stream",
        "test_stream_context_changes_only_the_calling_thread",
        "the current stream is process-wide, not per thread",
    ),
    "event_seconds": (
        "stream",
        "test_elapsed_time_is_in_milliseconds_of_the_host_clock",
        "elapsed_time in seconds instead of milliseconds",
    ),
    "device_set_not_kept": (
        "device",
        "test_several_devices_are_told_apart",
        "set_device is validated but not kept",
    ),
    "device_properties_of_current": (
        "device",
        "test_several_devices_are_told_apart",
        "device_properties(i) describes the current device",
    ),
    "determinism_env_leak": (
        "determinism",
        "test_apply_changes_only_what_it_records_and_restore_returns_every_setting[from-off]",
        "the policy sets an environment variable it does not record or undo",
    ),
    "determinism_restore_off": (
        "determinism",
        "test_apply_changes_only_what_it_records_and_restore_returns_every_setting[from-on]",
        "restore switches determinism off instead of back",
    ),
    "determinism_noop": (
        "determinism",
        "test_order_sensitive_training_is_bitwise_repeatable",
        "the determinism hook records a setting but sets nothing",
    ),
    "probe_sets_env": (
        "hygiene",
        "test_probe_leaves_environment_and_torch_settings_unchanged",
        "the probe sets an environment variable (CUDA_DEVICE_ORDER)",
    ),
    "pinned_alloc_wrong_dtype": (
        "memory",
        "test_alloc_pinned_has_the_shape_and_dtype_asked_and_is_writable",
        "alloc_pinned returns float32 whatever dtype is asked",
    ),
    "pinned_alloc_pageable": (
        "memory",
        "test_alloc_pinned_is_page_locked_and_non_blocking_copies_are_correct",
        "alloc_pinned returns a pageable buffer",
    ),
    "pinned_free_keeps_memory": (
        "memory",
        "test_free_pinned_releases_the_storage_and_refuses_any_other_tensor",
        "free_pinned releases nothing",
    ),
    "pinned_free_accepts_any": (
        "memory",
        "test_free_pinned_releases_the_storage_and_refuses_any_other_tensor",
        "free_pinned releases tensors that are not its own",
    ),
    "async_one_pending_slot": (
        "comm",
        "test_all_reduce[avg-float32-async-two-groups-w4]",
        "asynchronous all-reduces share one pending slot: a second in flight replaces the first",
    ),
    "capabilities_touch_device": (
        "hygiene",
        "test_a_hook_that_never_needs_a_device_context_creates_none[ds_backend_capabilities]",
        "ds_backend_capabilities initialises a (fake) vendor runtime",
    ),
    "host_stream_query_pending": (
        "stream",
        "test_without_async_streams_work_is_complete_when_queued",
        "a synchronous stream's query() says work is pending",
    ),
    "index_out_of_range_accepted": (
        "device",
        "test_an_optional_index_in_range_none_out_of_range_and_of_the_wrong_type"
        "[ds_memory_allocated]",
        "memory_allocated(index) accepts an index out of range or of another type",
    ),
    "seed_out_of_range_accepted": (
        "rng",
        "test_a_seed_at_each_end_of_its_range_out_of_it_and_of_the_wrong_type[False]",
        "manual_seed maps a negative seed instead of refusing it",
    ),
    "priority_not_checked": (
        "stream",
        "test_a_priority_in_and_past_any_range_and_of_the_wrong_type",
        "stream creation accepts a priority that is no int",
    ),
    "sim_stream_wait_noop": (
        "stream",
        "test_a_wait_orders_work_queued_on_another_stream[created-Stream.wait_stream]",
        "sim: Stream.wait_stream and Stream.wait_event order nothing (lazy mode)",
    ),
    "sim_event_wait_noop": (
        "stream",
        "test_a_wait_orders_work_queued_on_another_stream[created-Event.wait]",
        "sim: Event.wait(stream) orders nothing (lazy mode)",
    ),
    "sim_all_gather_wait_noop": (
        "comm",
        "test_all_gather[float32-async-stream-wait-orders-w2]",
        "sim: an asynchronous all-gather's wait() orders nothing (lazy mode)",
    ),
    "p2p_recv_retries_dead_peer": (
        "comm",
        "test_a_dead_peer_is_an_error_not_a_hang[recv-sync]",
        "a receive from an exited peer retries forever instead of raising",
    ),
    "sim_prepare_creates_device": (
        "hygiene",
        "test_a_hook_that_never_needs_a_device_context_creates_none[ds_comm_prepare]",
        "sim: ds_comm_prepare creates the device to register its process-group library",
    ),
}

#: Environment of the suite's run on a broken backend besides the installer's: the broken sim
#: backends run in ``lazy`` mode, where queued work runs only when something waits for it, so
#: a missing wait gives a wrong result every time (backends/sim/README.md).
ENV: dict[str, dict[str, str]] = {
    **{
        stem: {"DS_SIM_ASYNC": "lazy", "DS_SIM_DEVICES": "4"}
        for stem in ("sim_stream_wait_noop", "sim_event_wait_noop", "sim_all_gather_wait_noop")
    },
    # the planted receive hangs for as long as the suite waits: 5 s, not the default 30 s, is
    # still far above the milliseconds a send to the exited peer (which must pass) takes to raise
    "p2p_recv_retries_dead_peer": {"DS_CONFORMANCE_HANG_S": "5"},
}

#: broken backend -> tests of its category that must pass, so a check that fails is shown to
#: fail for its planted bug rather than for everything (the pinned-memory clones cannot
#: page-lock on a CPU build of torch, so their page-locking check fails whatever is planted).
MUST_PASS: dict[str, tuple[str, ...]] = {
    "memory_ignores_cgroup_v2": ("test_values_follow_an_imposed_cgroup_limit[cgroup-v1-limited]",),
    "memory_ignores_cgroup_v1": ("test_values_follow_an_imposed_cgroup_limit[cgroup-v2-limited]",),
    "memory_ignores_parent_cgroup": (
        "test_values_follow_an_imposed_cgroup_limit[cgroup-v2-limited]",
        "test_values_follow_an_imposed_cgroup_limit[cgroup-v1-limited]",
    ),
    "pinned_alloc_wrong_dtype": (
        "test_free_pinned_releases_the_storage_and_refuses_any_other_tensor",
    ),
    "pinned_alloc_pageable": (
        "test_alloc_pinned_has_the_shape_and_dtype_asked_and_is_writable",
        "test_free_pinned_releases_the_storage_and_refuses_any_other_tensor",
    ),
    "pinned_free_keeps_memory": (
        "test_alloc_pinned_has_the_shape_and_dtype_asked_and_is_writable",
    ),
    "pinned_free_accepts_any": ("test_alloc_pinned_has_the_shape_and_dtype_asked_and_is_writable",),
    # the one broken wait is what fails: the other kinds of wait still order the copy
    "sim_event_wait_noop": (
        "test_a_wait_orders_work_queued_on_another_stream[created-Stream.wait_event]",
        "test_a_wait_orders_work_queued_on_another_stream[created-Stream.wait_stream]",
    ),
    "sim_all_gather_wait_noop": ("test_all_reduce[sum-float32-async-stream-wait-orders-w2]",),
    # the index axis fails on the one hook planted, not on its neighbours
    "index_out_of_range_accepted": (
        "test_an_optional_index_in_range_none_out_of_range_and_of_the_wrong_type"
        "[ds_memory_reserved]",
    ),
    "seed_out_of_range_accepted": ("test_seed_reproduces_draws",),
    "capabilities_touch_device": (
        "test_a_hook_that_never_needs_a_device_context_creates_none[ds_backend_info]",
    ),
    # only the receive hangs: a send to the same dead peer still raises
    "p2p_recv_retries_dead_peer": ("test_a_dead_peer_is_an_error_not_a_hang[send-sync]",),
    "sim_prepare_creates_device": (
        "test_a_hook_that_never_needs_a_device_context_creates_none[ds_op_providers]",
    ),
}

#: Checks that must fail besides the one in :data:`BROKEN`.
ALSO_FAILS: dict[str, tuple[str, ...]] = {
    "probe_touches_device": ("test_probe_imports_only_documented_modules",),
    "sim_stream_wait_noop": (
        "test_a_wait_orders_work_queued_on_another_stream[created-Stream.wait_event]",
        "test_work_queued_by_another_thread_is_ordered_by_a_wait_on_this_one[Stream.wait_stream]",
    ),
    "sim_event_wait_noop": (
        "test_work_queued_by_another_thread_is_ordered_by_a_wait_on_this_one[Event.wait]",
    ),
}

#: The pytest arguments that narrow a broken backend's run to the checks its test asserts on:
#: the ones that must fail and the ones that must pass. The rest of the category proves
#: nothing about the fault, and running it cost most of this file's time (the memory category
#: starts cgroup and rlimit subprocesses, the comm category 2- and 4-rank groups).
NARROW: dict[str, tuple[str, ...]] = {
    stem: ("-k", " or ".join((must, *ALSO_FAILS.get(stem, ()), *MUST_PASS.get(stem, ()))))
    for stem, (_, must, _) in BROKEN.items()
}

_IDENTITY = """

@hookimpl
def ds_backend_info():
    return BackendInfo(name={name!r}, device_type={device_type!r}, priority=0,
                       hookspec_version={version}, description="deliberately broken test backend")
"""


def install(root: Path, stem: str, name: str | None = None) -> str:
    """Write broken backend ``stem`` as an installed distribution in ``root``; return its name.

    The backend's entry point name is ``name`` (default: ``stem`` with ``-`` for ``_``).
    """
    name = name or stem.replace("_", "-")
    source = (HERE / f"{stem}.py").read_text()
    # helper modules the backend imports: its own, and those shared by several backends
    for extra in [*HERE.glob(f"{stem}__*.py"), *HERE.glob("_shared__*.py")]:
        (root / extra.name.split("__", 1)[1]).write_text(extra.read_text())
    make_backend(
        root,
        name,
        module=f"ds_broken_{stem}",
        body=source
        + _IDENTITY.format(
            # the broken sim backends (sim_*) are the sim device with one hook broken
            name=name,
            device_type="sim" if stem.startswith("sim_") else "cpu",
            version=HOOKSPEC_VERSION,
        ),
    )
    return name

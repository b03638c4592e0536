"""One rank of a conformance group (``python -m ds_conformance._rank_worker``).

Runs the requested jobs (``--jobs comm,zero``, or ``dead_peer`` alone) on the backend named by ``DS_ACCELERATOR``
and writes one JSON object ``{result key: "" | failure}`` to ``--out``. A case that raises is
recorded and the rank goes on, so one broken collective does not hide the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} ({os.path.basename(last.filename)}:{last.lineno})"


def _comm(
    acc: Any, rank: int, world: int, scratch: Path, selected: set[str] | None
) -> dict[str, str]:
    from ds_conformance.comm_cases import SUBGROUPS, Context, cases, run_case
    from ds_core import comm

    # Every rank creates every subgroup, in the same order (torch.distributed requires it).
    groups = {g: comm.new_group(list(g)) for g in SUBGROUPS} if world == 4 else {}
    ctx = Context(acc=acc, rank=rank, scratch=scratch, groups=groups)
    results: dict[str, str] = {}
    for case in cases(acc.supported_dtypes()):
        if case.world != world or (selected is not None and case.key not in selected):
            continue
        if case.capability and case.capability not in acc.capabilities:
            continue  # the test reports it skipped (capability absent)
        try:
            run_case(ctx, case)
            results[case.key] = ""
        except Exception as exc:
            results[case.key] = _describe(exc)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", default="comm")
    parser.add_argument("--cases", help="a JSON list of the case keys to run (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    os.environ.update(
        RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        LOCAL_RANK=str(args.rank),
        LOCAL_WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
    )
    import torch

    torch.set_num_threads(1)  # ranks share the host's cores
    import ds_core

    ds_core.init_distributed(timeout=args.timeout)
    acc = ds_core.get_accelerator()
    jobs = {j for j in args.jobs.split(",") if j}
    results: dict[str, str] = {}
    if "comm" in jobs:
        selected = set(json.loads(Path(args.cases).read_text())) if args.cases else None
        results.update(_comm(acc, args.rank, args.world, Path(args.out).parent, selected))
    if "dead_peer" in jobs:  # a group of its own: one rank dies, so no clean shutdown
        from ds_conformance import comm_dead_peer

        selected = set(json.loads(Path(args.cases).read_text())) if args.cases else None
        try:
            results.update(comm_dead_peer.run(acc, args.rank, Path(args.out).parent, selected))
        except Exception as exc:  # before any scenario ran: every one fails with it
            results["dead_peer[setup]"] = _describe(exc)
        with open(args.out, "w") as f:
            json.dump(results, f)
        os._exit(0)  # destroying groups whose peer died may block; the rank only leaves
    if "zero" in jobs:
        from ds_conformance.zero_smoke import WORLD, run_all

        if args.world == WORLD:
            try:
                results.update(run_all(acc, args.rank))
            except Exception as exc:  # a crash outside one stage fails every stage
                results["zero[setup]"] = _describe(exc)
    with open(args.out, "w") as f:
        json.dump(results, f)
    ds_core.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

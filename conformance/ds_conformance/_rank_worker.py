"""One rank of the conformance suite's collective group (``python -m ds_conformance._rank_worker``).

Runs every collective case in order on the backend named by ``DS_ACCELERATOR`` and writes one
JSON object ``{case id: "" | failure}`` to ``--out``. A case that raises is recorded and the
rank goes on, so one broken collective does not hide the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
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
    from ds_conformance.comm_cases import cases, run_case

    ds_core.init_distributed(timeout=args.timeout)
    acc = ds_core.get_accelerator()
    results: dict[str, str] = {}
    for case in cases(acc.supported_dtypes()):
        if case.world != args.world:
            continue
        key = f"{case.collective}[{case.id}]"
        try:
            run_case(acc, case, args.rank)
            results[key] = ""
        except Exception as exc:
            last = traceback.extract_tb(exc.__traceback__)[-1]
            results[key] = (
                f"{type(exc).__name__}: {exc} ({os.path.basename(last.filename)}:{last.lineno})"
            )
    with open(args.out, "w") as f:
        json.dump(results, f)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

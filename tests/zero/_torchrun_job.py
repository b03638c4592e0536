"""One torchrun rank: train the stage scenarios named on the command line, save the results.

``torchrun ... tests/zero/_torchrun_job.py OUTDIR s2 s3`` (scenario names of a 2-rank world).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ds_core  # noqa: E402
from tests.zero._worker import stage_scenarios, train  # noqa: E402


def main() -> None:
    outdir, names = sys.argv[1], sys.argv[2:]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    ds_core.init_distributed(timeout=300)
    rank = int(os.environ["RANK"])
    for name in names:
        torch.save(train(stage_scenarios(2)[name]), os.path.join(outdir, f"{name}.rank{rank}.pt"))
    # Tear the groups down before exit: gloo's threads must not outlive the interpreter.
    torch.distributed.barrier()
    ds_core.destroy_distributed()


if __name__ == "__main__":
    main()

"""ZeRO-Offload on the GPT example: step time and device/host model-state memory, with and
without offload, stages 2 and 3, 2 ranks, in one run.

Run: ``python bench/offload.py`` (the ``large`` preset, about 10 minutes here), or
``python bench/offload.py --preset small --rounds 1 --steps 3`` for a quick look. Any flag of
``bench/zero_vs_peers.py`` works (``--world``, ``--json``, ...).

Configurations: ``ds2`` / ``ds3`` (no offload), ``ds2_off`` / ``ds3_off``
(``offload_optimizer: cpu``: fp32 masters and Adam state on the host, stepped there by
cpu_adam), ``ds3_param`` (``offload_param: cpu``: stage-3 parameter shards on the host) and
``ds3_off_param`` (both). The table is ``zero_vs_peers``'s: step time (``time/peer`` against
the same stage without offload), peak resident memory during the measured steps, the
model-state bytes that stay on the device, and below it the host bytes per rank. On this CPU
machine host and device are the same memory, so the device/host split is the engine's own
accounting and the step-time cost is the extra copies and the host optimizer; on an
accelerator the same run shows what offload frees on the device.

It prints and never asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import zero_vs_peers  # noqa: E402

CONFIGS = "ds2,ds2_off,ds3,ds3_off,ds3_param,ds3_off_param"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--configs" or a.startswith("--configs=") for a in args):
        args += ["--configs", CONFIGS]
    if not any(a == "--preset" or a.startswith("--preset=") for a in args):
        args += ["--preset", "large"]
    zero_vs_peers.main(args)


if __name__ == "__main__":
    main()

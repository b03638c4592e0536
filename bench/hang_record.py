"""Cost of the hang check's per-collective record (ds_core/hangs.py) on the training thread.

Run: ``python bench/hang_record.py [--number N] [--repeat R]``. In one process (a world of one
rank over the CPU backend) prints µs per call, best of R rounds of N calls:

- ``note``: :func:`ds_core.hangs.note` alone (what every facade collective adds);
- ``all_reduce on`` / ``off``: the facade's ``all_reduce`` of one element with the record on
  and off (``hangs.enable``), the whole call a training step pays per collective.

Never asserts (docs/architecture.md §3.11).
"""

from __future__ import annotations

import argparse
import os
import timeit

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import ds_core
    from ds_core import hangs

    ds_core.init_distributed()
    acc = ds_core.get_accelerator()
    t = torch.ones(1)

    def once(fn: object) -> float:
        return timeit.timeit(fn, number=args.number) / args.number * 1e6  # type: ignore[arg-type]

    def reduce() -> None:
        acc.all_reduce(t)

    once(reduce)  # warm-up: the first thousands of calls run several times slower
    # on and off alternate within each round: a loaded machine slows both alike
    note, on, off = [], [], []
    for _ in range(args.repeat):
        note.append(once(lambda: hangs.note("all_reduce", None, t.numel(), t.dtype)))
        on.append(once(reduce))
        hangs.enable(False)
        off.append(once(reduce))
        hangs.enable(True)
    note_us, on_us, off_us = min(note), min(on), min(off)
    print(f"note                {note_us:8.3f} µs/call")
    print(f"all_reduce on       {on_us:8.3f} µs/call")
    print(f"all_reduce off      {off_us:8.3f} µs/call")
    print(f"record's share      {on_us - off_us:8.3f} µs/call")
    ds_core.destroy_distributed()


if __name__ == "__main__":
    main()

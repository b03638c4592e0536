"""``ds-core checkpoint convert | export | inspect``: offline tools, no process group needed.

- ``convert SRC DST``: a native checkpoint to the universal format (loads at any world size
  and stage), published atomically under the same tag in the checkpoint root ``DST``;
- ``export SRC OUT``: the consolidated model as ``.safetensors`` or ``.pt`` (``--dtype``);
- ``inspect SRC``: tag, format, stage, world size, steps, parameters, bytes, and whether every
  file matches the manifest. Exits 1 when it does not.

``SRC`` is a checkpoint root (``latest`` picks the tag; ``--tag`` another) or a tag folder.
"""

from __future__ import annotations

import argparse
import json
import sys

from ds_core.checkpoint._io import CheckpointError
from ds_core.checkpoint.export import convert_to_universal, export_checkpoint, inspect_checkpoint


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = "Convert, export and inspect ds_core checkpoints (offline)."
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    conv = sub.add_parser("convert", help="native -> universal format")
    conv.add_argument("src", help="checkpoint root or tag folder")
    conv.add_argument("dst", help="checkpoint root to write the universal copy into")
    conv.add_argument("--tag", help="tag to convert (default: the one 'latest' names)")
    exp = sub.add_parser("export", help="consolidated state dict (.safetensors or .pt)")
    exp.add_argument("src", help="checkpoint root or tag folder")
    exp.add_argument("out", help="output file: *.safetensors, *.pt, *.pth or *.bin")
    exp.add_argument("--tag", help="tag to export (default: the one 'latest' names)")
    exp.add_argument(
        "--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="(default fp32)"
    )
    ins = sub.add_parser("inspect", help="summary and manifest verification")
    ins.add_argument("src", help="checkpoint root or tag folder")
    ins.add_argument("--tag", help="tag to inspect (default: the one 'latest' names)")
    ins.add_argument("--json", action="store_true", help="print JSON")
    ins.add_argument("--no-verify", action="store_true", help="skip hashing every file")


def run(args: argparse.Namespace) -> int:
    try:
        if args.checkpoint_command == "convert":
            print(f"wrote {convert_to_universal(args.src, args.dst, args.tag)}")
            return 0
        if args.checkpoint_command == "export":
            print(f"wrote {export_checkpoint(args.src, args.out, args.tag, args.dtype)}")
            return 0
        summary = inspect_checkpoint(args.src, args.tag, verify=not args.no_verify)
    except CheckpointError as exc:
        print(f"ds-core checkpoint {args.checkpoint_command}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        verified = summary["verified"]
        rows = [
            ("folder", summary["folder"]),
            ("tag", summary["tag"]),
            ("format", summary["format"]),
            ("zero stage", summary["stage"]),
            ("world size", summary["world_size"]),
            ("dtype", summary["dtype"]),
            ("global steps", summary["global_steps"]),
            ("global samples", summary["global_samples"]),
            ("skipped steps", summary["skipped_steps"]),
            ("parameters", f"{summary['parameters']:,} in {summary['tensors']} tensors"),
            ("bytes", f"{summary['bytes']:,}"),
            ("saved by", ", ".join(f"{k} {v}" for k, v in summary["versions"].items())),
            (
                "manifest",
                "not checked"
                if verified is None
                else "verified (every file's size and SHA-256)"
                if verified is True
                else f"FAILED: {verified}",
            ),
        ]
        for k, v in rows:
            print(f"{k:>15}: {v}")
    return 0 if summary["verified"] in (True, None) else 1

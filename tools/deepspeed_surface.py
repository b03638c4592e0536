"""Which ``deepspeed.*`` names real programs use, and what ds_core answers for each.

Give it source trees (plain directories, or bare git directories read at ``HEAD``), each with
a label and optionally the paths inside it to read::

    python tools/deepspeed_surface.py \\
        --source examples /path/to/DeepSpeedExamples training applications/DeepSpeed-Chat \\
        --source accelerate /path/to/accelerate.git src/accelerate/utils/deepspeed.py \\
        --out surface.md

Every ``.py`` file is parsed with :mod:`ast`; a name counts when it is imported
(``import deepspeed.x``, ``from deepspeed.x import y [as z]``) or reached through an attribute
chain on a name bound to deepspeed or one of its modules (``deepspeed.zero.Init``,
``dist.get_rank`` after ``import deepspeed.comm as dist``). Each name is counted once per
source, however often that source uses it. For each name the table gives ds_core's answer:
provided (the same path below ``ds_core`` imports and resolves), refused (:data:`REFUSED`
says why), or missing.

Files that do not parse (Python 2 in old examples) are skipped and counted.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = "deepspeed"

#: Names ds_core does not provide on purpose, by dotted prefix below ``deepspeed``; the longest
#: matching prefix gives the reason.
REFUSED: dict[str, str] = {
    "pipe": "of the pipeline API, ds_core.pipe has PipelineModule, LayerSpec, TiedLayerSpec "
    "and the schedules",
    "runtime.pipe": "DeepSpeed's pipeline internals: ds_core's pipeline is at ds_core.pipe "
    "and ds_core.parallel.pipeline",
    "PipelineModule": "at ds_core.pipe.PipelineModule (DeepSpeed's public path), not the top level",
    "PipelineEngine": "at ds_core.parallel.pipeline.PipelineEngine, not the top level",
    "init_inference": "DeepSpeed-Inference (kernel injection) is not part of ds_core",
    "inference": "DeepSpeed-Inference (kernel injection) is not part of ds_core",
    "InferenceEngine": "DeepSpeed-Inference (kernel injection) is not part of ds_core",
    "module_inject": "kernel injection replaces modules with CUDA kernels: not part of ds_core",
    "model_implementations": "DeepSpeed-Inference model implementations: not part of ds_core",
    "ops.transformer": "CUDA-only fused transformer kernels",
    "ops.sparse_attention": "CUDA/Triton-only sparse attention kernels",
    "ops.deepspeed4science": "CUDA-only kernels",
    "ops.op_builder": "DeepSpeed's op build system; ds_core ops build through ds_core.ops",
    "op_builder": "DeepSpeed's op build system; ds_core ops build through ds_core.ops",
    "ops.lamb": "CUDA-only fused LAMB",
    "ops.adagrad": "CPU Adagrad op not ported",
    "ops.lion": "Lion ops not ported",
    "ops.aio": "async I/O: ds_core.io",
    "ops.fp_quantizer": "CUDA-only quantizer kernels",
    "compression": "DeepSpeed-Compression is not part of ds_core",
    "sequence": "of Ulysses, ds_core provides sequence.layer.DistributedAttention and "
    "sequence.cross_entropy's vocab_(sequence_)parallel_cross_entropy only",
    "sequence.fpdt_layer": "FPDT (chunked Ulysses attention with offload): not implemented",
    "runtime.sequence_parallel": "DeepSpeed's Hugging Face Ulysses integration: not "
    "implemented (ds_core.sequence.layer.DistributedAttention is the layer)",
    "runtime.activation_checkpointing": "use ds_core.checkpointing (deepspeed.checkpointing's path)",
    "profiling": "DeepSpeed's flops profiler is not part of ds_core",
    "autotuning": "DeepSpeed's autotuner is not part of ds_core",
    "monitor": "DeepSpeed's monitor (TensorBoard/W&B/CSV) is not part of ds_core",
    "runtime.data_pipeline": "DeepSpeed's data-efficiency pipeline is not part of ds_core",
    "runtime.fp16.onebit": "1-bit optimizers need compressed communication: not implemented",
    "runtime.fp16.loss_scaler": "loss scaling is internal to ds_core's engine",
    "runtime.utils": "DeepSpeed-internal helpers",
    "runtime.zero.stage_1_and_2": "the ZeRO optimizer is internal to ds_core's engine",
    "runtime.zero.stage3": "the ZeRO optimizer is internal to ds_core's engine",
    "runtime.zero.offload_config": "offload is configured by the config dict",
    "runtime.hybrid_engine": "DeepSpeed-Chat's hybrid engine (inference kernels): not part of ds_core",
    "runtime.engine.DeepSpeedOptimizerCallable": "DeepSpeed-internal typing alias",
    "runtime.bf16_optimizer": "the bf16 optimizer is internal to ds_core's engine",
    "runtime.config_utils": "DeepSpeed's pydantic config base is internal",
    "checkpoint": "DeepSpeed's universal-checkpoint reshaping: ds_core.checkpoint has its own",
    "utils.zero_to_fp32": "use ds_core.checkpoint's export",
    "utils.debug": "DeepSpeed-internal debug helpers",
    "utils.timer": "DeepSpeed's timers: engine.tput_timer only",
    "git_version_info": "DeepSpeed build metadata",
    "env_report": "DeepSpeed build metadata",
    "launcher": "ds_core has its own launcher (python -m ds_core.cli)",
    "elasticity": "elastic training is not part of ds_core",
    "nebula": "Azure Nebula checkpointing is not part of ds_core",
    "linear": "DeepSpeed's LoRA/quantized linear layers are not part of ds_core",
    "zero.register_external_parameter": "stage 3 gathers a parameter for the modules that own "
    "it; gathering for another module needs engine support (a later change)",
    "DeepSpeedTransformerLayer": "CUDA-only fused transformer kernels",
    "DeepSpeedTransformerConfig": "CUDA-only fused transformer kernels",
    "replace_transformer_layer": "kernel injection replaces modules with CUDA kernels",
    "runtime.domino": "Domino tensor-parallel overlap: not implemented",
    "runtime.state_dict_factory": "Megatron checkpoint loaders: not part of ds_core",
    "runtime.config.LAMB_OPTIMIZER": "LAMB is not among ds_core's optimizers",
    "runtime.config.ONEBIT_LAMB_OPTIMIZER": "1-bit LAMB is not among ds_core's optimizers",
}

#: Attribute chains stop after a component that is an object, not a module: a class or
#: constant (capitalised) or one of these; what follows is that object's member.
OBJECTS = frozenset({"logger"})


@dataclass
class Use:
    """One name: the sources that use it and the files where it was seen."""

    sources: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


@dataclass
class Scan:
    uses: dict[str, Use] = field(default_factory=dict)
    files: int = 0
    unparsable: list[str] = field(default_factory=list)

    def add(self, name: str, source: str, where: str) -> None:
        use = self.uses.setdefault(name, Use())
        use.sources.add(source)
        use.files.add(where)


# --- reading source trees -------------------------------------------------------------------


def _is_bare_git(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def _wanted(rel: str, under: tuple[str, ...]) -> bool:
    return not under or any(rel == u or rel.startswith(u.rstrip("/") + "/") for u in under)


def read_tree(path: Path, under: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """``(relative path, text)`` of every ``.py`` file in a directory or bare git dir, limited
    to the files at or below ``under`` when given."""
    if _is_bare_git(path):
        yield from _read_git(path, under)
        return
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            if _wanted(rel, under):
                yield rel, full.read_text(encoding="utf-8", errors="replace")


def _read_git(git_dir: Path, under: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    git = ["git", f"--git-dir={git_dir}"]
    listing = subprocess.run(
        [*git, "ls-tree", "-r", "-z", "HEAD"], check=True, capture_output=True
    ).stdout.decode()
    entries = []  # (object id, path)
    for line in filter(None, listing.split("\0")):
        meta, rel = line.split("\t", 1)
        _mode, kind, oid = meta.split()
        if kind == "blob" and rel.endswith(".py") and _wanted(rel, under):
            entries.append((oid, rel))
    if not entries:
        return
    batch = subprocess.run(
        [*git, "cat-file", "--batch"],
        input="".join(f"{oid}\n" for oid, _ in entries).encode(),
        check=True,
        capture_output=True,
    ).stdout
    pos = 0
    for _oid, rel in entries:
        header_end = batch.index(b"\n", pos)
        header = batch[pos:header_end].split()
        if header[-1] == b"missing":
            pos = header_end + 1
            continue
        size = int(header[2])
        body = batch[header_end + 1 : header_end + 1 + size]
        pos = header_end + 1 + size + 1  # the blob is followed by a newline
        yield rel, body.decode("utf-8", errors="replace")


# --- finding names --------------------------------------------------------------------------


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; ``None`` when the chain does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _object_prefix(parts: list[str]) -> str:
    """``parts`` up to the first object component (see :data:`OBJECTS`), joined."""
    for i, part in enumerate(parts[1:], start=1):
        if part[:1].isupper() or part in OBJECTS:
            return ".".join(parts[: i + 1])
    return ".".join(parts)


def names_in(text: str) -> set[str]:
    """Every ``deepspeed.*`` name one module's text imports or reaches (raises SyntaxError)."""
    tree = ast.parse(text)
    aliases: dict[str, str] = {}  # local name -> dotted deepspeed path
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name != ROOT and not a.name.startswith(ROOT + "."):
                    continue
                found.add(a.name)
                if a.asname:
                    aliases[a.asname] = a.name
                else:  # `import deepspeed.comm` binds `deepspeed`
                    aliases[ROOT] = ROOT
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level or not (mod == ROOT or mod.startswith(ROOT + ".")):
                continue
            for a in node.names:
                if a.name == "*":
                    found.add(mod)
                    continue
                dotted = f"{mod}.{a.name}"
                found.add(dotted)
                aliases[a.asname or a.name] = dotted
    if not aliases:
        return {n for n in found if n != ROOT}
    outer: set[int] = set()  # attribute nodes inside a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            outer.add(id(node.value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in outer:
            continue
        parts = _chain(node)
        if parts and parts[0] in aliases:
            found.add(_object_prefix([*aliases[parts[0]].split("."), *parts[1:]]))
    return {n for n in found if n != ROOT}


def scan(sources: Iterable[tuple[str, Path, tuple[str, ...]]]) -> Scan:
    result = Scan()
    for label, path, under in sources:
        for rel, text in read_tree(path, under):
            result.files += 1
            try:
                names = names_in(text)
            except (SyntaxError, ValueError):
                result.unparsable.append(f"{label}:{rel}")
                continue
            for name in names:
                result.add(name, label, f"{label}:{rel}")
    return result


# --- ds_core's answer -----------------------------------------------------------------------


def ds_core_path(name: str) -> str:
    return "ds_core" + name[len(ROOT) :]


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute reached from the longest importable
    module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        except Exception:
            return False
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except Exception:
            return False
        return True
    return False


def refusal(name: str) -> str | None:
    rest = name[len(ROOT) + 1 :]
    best = None
    for prefix in REFUSED:
        if (rest == prefix or rest.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return REFUSED[best] if best is not None else None


def answer(name: str) -> tuple[str, str]:
    """``("provided" | "refused" | "missing", text for the table)``."""
    target = ds_core_path(name)
    if resolves(target):
        return "provided", f"provided: `{target}`"
    why = refusal(name)
    if why is not None:
        return "refused", f"refused: {why}"
    return "missing", "missing"


def table(result: Scan, labels: list[str]) -> tuple[str, dict[str, int]]:
    counts = {"names": len(result.uses), "provided": 0, "refused": 0, "missing": 0}
    rows = [
        "| name | sources | ds_core |",
        "|---|---|---|",
    ]
    order = sorted(result.uses.items(), key=lambda kv: (-len(kv[1].sources), kv[0]))
    for name, use in order:
        kind, text = answer(name)
        counts[kind] += 1
        used_by = ", ".join(label for label in labels if label in use.sources)
        rows.append(f"| `{name}` | {len(use.sources)} ({used_by}) | {text} |")
    return "\n".join(rows) + "\n", counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        nargs="+",
        action="append",
        required=True,
        metavar=("LABEL PATH", "UNDER"),
        help="a label, a directory or bare git dir, then optional paths inside it to read",
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here (default: stdout)")
    args = parser.parse_args(argv)
    sources = []
    for spec in args.source:
        if len(spec) < 2:
            parser.error("--source needs a label and a path")
        sources.append((spec[0], Path(spec[1]), tuple(spec[2:])))
    result = scan(sources)
    text, counts = table(result, [s[0] for s in sources])
    summary = (
        f"{counts['names']} names in {result.files} files "
        f"({len(result.unparsable)} unparsable, skipped): {counts['provided']} provided, "
        f"{counts['refused']} refused, {counts['missing']} missing"
    )
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    print(summary, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

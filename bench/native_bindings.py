"""ctypes against cffi (API mode) for ds_core's three C helpers: build time, import, call cost.

Run: ``python bench/native_bindings.py [--number N] [--builds B]``. Needs ``cffi`` importable
(it is not a dependency of ds_core: ``pip install --target /tmp/cffi cffi`` and
``PYTHONPATH=/tmp/cffi``); without it only the ctypes figures print. Never asserts; the
decision it informed is docs/architecture.md §3.13.

Prints, from one run (configurations interleaved, medians):

- **build**: a cold build of each helper into a fresh cache: ``build_shared_library`` (what
  ds_core does), cffi's ``ffi.compile()`` (setuptools, the documented API-mode path) and
  ``ffi.emit_c_code()`` + one compiler command (API mode through ds_core.ops' own pipeline);
- **import**: ``ctypes.CDLL`` of the built library against importing the cffi module;
- **call**: ns per call of each helper's hot function (best of 5 rounds of ``--number``
  calls), ctypes with argtypes against cffi, with the pointer casts a caller must make
  (cffi takes no int for a pointer argument) and without (the floor).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "backends" / "cpu")]

import torch  # noqa: E402

from ds_core.ops import build_shared_library  # noqa: E402

try:
    import cffi  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:
    cffi = None

# name -> (source, cdef, cflags, ldflags, openmp)
HELPERS: dict[str, tuple[Path, str, list[str], list[str], bool]] = {
    "shm_sync": (
        ROOT / "backends/cpu/ds_backend_cpu/csrc/shm_sync.c",
        """
        void ds_shm_store(uint64_t *base, int64_t index, uint64_t value, int64_t sleepers);
        uint64_t ds_shm_load(uint64_t *base, int64_t index);
        int64_t ds_shm_wait_all(uint64_t *base, const int64_t *indices, int64_t n,
                                uint64_t target, double slice_s, int64_t sleepers);
        """,
        ["-std=c11"],
        [],
        False,
    ),
    "async_io": (
        ROOT / "ds_core/ops/csrc/async_io.c",
        """
        int ds_aio_transfer(const char *path, int is_write, void *buf, int64_t nbytes,
                            int64_t offset, int64_t block, int nthreads, int direct,
                            int64_t align, int64_t *err_at);
        """,
        ["-std=c11", "-Wall", "-pthread"],
        ["-pthread"],
        False,
    ),
    "cpu_adam": (
        ROOT / "ds_core/ops/csrc/cpu_adam.c",
        """
        int ds_cpu_adam_step(float *p, const float *grad, float *m, float *v, int64_t n,
                             float grad_scale, float l2, float decay, float beta1, float omb1,
                             float beta2, float omb2, float inv_bc2_sqrt, float eps,
                             float step_size, int adam_l2, void *out16, int out_kind,
                             int nthreads);
        void ds_cpu_adam_touch(float *p, const float *g, float *m, float *v, int64_t n,
                               void *out16, int nthreads);
        const char *ds_cpu_adam_isa(void);
        int ds_cpu_adam_openmp(void);
        int ds_cpu_adam_has_fp16(void);
        int64_t ds_cpu_adam_stream_min(void);
        """,
        ["-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
        [],
        True,
    ),
}


def _ffi(name: str) -> Any:
    source, cdef, cflags, ldflags, openmp = HELPERS[name]
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    omp = ["-fopenmp"] if openmp else []
    ffi.set_source(
        f"_bench_{name}",
        source.read_text(),
        extra_compile_args=["-O3", *cflags, *omp],
        extra_link_args=[*ldflags, *omp],
    )
    return ffi


def build_ctypes(name: str, cache: Path) -> Path:
    source, _cdef, cflags, ldflags, openmp = HELPERS[name]
    os.environ["DS_CORE_OPS_CACHE"] = str(cache)
    lib = build_shared_library(
        f"bench_{name}_{cache.name}", [source], cflags=cflags, ldflags=ldflags,
        openmp=openmp, quiet=True,
    )  # fmt: skip
    return Path(lib._name)


def build_cffi_setuptools(name: str, folder: Path) -> Path:
    return Path(_ffi(name).compile(tmpdir=str(folder), verbose=False))


def build_cffi_emit(name: str, folder: Path) -> Path:
    """API mode through one compiler command, as ds_core.ops would run it (no setuptools)."""
    _source, _cdef, cflags, ldflags, openmp = HELPERS[name]
    c_file = folder / f"_bench_{name}.c"
    _ffi(name).emit_c_code(str(c_file))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    out = folder / f"_bench_{name}{suffix}"
    omp = ["-fopenmp"] if openmp else []
    cmd = ["cc", "-O3", "-fPIC", "-shared", *omp, *cflags,
           f"-I{sysconfig.get_paths()['include']}", str(c_file), "-o", str(out), *ldflags]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def import_cffi(path: Path) -> Any:
    mod_name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(mod_name, str(path))
    spec = importlib.util.spec_from_file_location(mod_name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def bench_builds(builds: int) -> dict[str, dict[str, Path]]:
    """Cold builds, interleaved; returns one artefact per (helper, way) for the call bench."""
    ways: dict[str, Any] = {"ctypes (build_shared_library)": build_ctypes}
    if cffi is not None:
        ways["cffi API, ffi.compile (setuptools)"] = build_cffi_setuptools
        ways["cffi API, emit_c_code + cc"] = build_cffi_emit
    times: dict[tuple[str, str], list[float]] = {}
    kept: dict[str, dict[str, Path]] = {n: {} for n in HELPERS}
    base = Path(tempfile.mkdtemp(prefix="ds_bench_bind_"))
    for r in range(builds):
        for name in HELPERS:
            for w, (way, fn) in enumerate(ways.items()):
                folder = base / f"{name}_{w}_{r}"
                folder.mkdir(mode=0o700)
                started = time.perf_counter()
                kept[name][way] = fn(name, folder)
                times.setdefault((name, way), []).append(time.perf_counter() - started)
    print(f"\ncold build, median of {builds} (s)")
    print(f"{'helper':10} " + " ".join(f"{w:>34}" for w in ways))
    for name in HELPERS:
        row = [statistics.median(times[name, w]) for w in ways]
        print(f"{name:10} " + " ".join(f"{t:>34.2f}" for t in row))
    return kept


def bench_calls(kept: dict[str, dict[str, Path]], number: int) -> None:
    i64, u64, ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    lib = {n: ctypes.CDLL(str(kept[n]["ctypes (build_shared_library)"])) for n in HELPERS}
    shm = lib["shm_sync"]
    shm.ds_shm_store.argtypes, shm.ds_shm_store.restype = [ptr, i64, u64, i64], None
    shm.ds_shm_load.argtypes, shm.ds_shm_load.restype = [ptr, i64], u64
    shm.ds_shm_wait_all.argtypes = [ptr, ctypes.POINTER(i64), i64, u64, ctypes.c_double, i64]
    shm.ds_shm_wait_all.restype = i64
    aio = lib["async_io"].ds_aio_transfer
    aio.restype = ctypes.c_int
    aio.argtypes = [ctypes.c_char_p, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int,
                    ctypes.c_int, i64, ctypes.POINTER(i64)]  # fmt: skip
    adam = lib["cpu_adam"].ds_cpu_adam_step
    adam.restype = ctypes.c_int
    adam.argtypes = [*(ptr,) * 4, i64, *(ctypes.c_float,) * 10, ctypes.c_int, ptr,
                     ctypes.c_int, ctypes.c_int]  # fmt: skip

    words = torch.zeros(64, dtype=torch.int64)
    base_c = ctypes.c_void_p(words.data_ptr())
    idx_c = (i64 * 4)(1, 2, 3, 4)
    t = [torch.zeros(16) for _ in range(4)]
    scal = (1.0, 0.0, 1.0, 0.9, 0.1, 0.999, 0.001, 1.0, 1e-8, 1e-3)
    missing = "/nonexistent/ds_bench_no_such_file"

    def c_aio() -> None:
        at = i64(-1)
        aio(os.fsencode(missing), 0, t[0].data_ptr(), 64, 0, 64, 1, 0, 4096, ctypes.byref(at))

    def c_adam() -> None:
        adam(*(x.data_ptr() for x in t), 16, *scal, 0, None, 0, 1)

    cases: dict[str, dict[str, Any]] = {
        "shm load": {"ctypes": lambda: shm.ds_shm_load(base_c, 0)},
        "shm store": {"ctypes": lambda: shm.ds_shm_store(base_c, 0, 0, 8)},
        "shm wait_all (ready)": {
            "ctypes": lambda: shm.ds_shm_wait_all(base_c, idx_c, 4, 0, 0.0, 8)
        },
        "aio transfer (ENOENT)": {"ctypes": c_aio},
        "adam step (n=16)": {"ctypes": c_adam},
    }
    if cffi is not None:
        way = "cffi API, emit_c_code + cc"
        m = {n: import_cffi(kept[n][way]) for n in HELPERS}
        sffi, slib = m["shm_sync"].ffi, m["shm_sync"].lib
        base_f = sffi.cast("uint64_t *", words.data_ptr())
        idx_f = sffi.new("int64_t[]", [1, 2, 3, 4])
        cases["shm load"]["cffi"] = lambda: slib.ds_shm_load(base_f, 0)
        cases["shm store"]["cffi"] = lambda: slib.ds_shm_store(base_f, 0, 0, 8)
        cases["shm wait_all (ready)"]["cffi"] = lambda: slib.ds_shm_wait_all(
            base_f, idx_f, 4, 0, 0.0, 8
        )
        affi, alib = m["async_io"].ffi, m["async_io"].lib

        def f_aio() -> None:
            at = affi.new("int64_t *", -1)
            alib.ds_aio_transfer(os.fsencode(missing), 0, affi.cast("void *", t[0].data_ptr()),
                                 64, 0, 64, 1, 0, 4096, at)  # fmt: skip

        cases["aio transfer (ENOENT)"]["cffi"] = f_aio
        dffi, dlib = m["cpu_adam"].ffi, m["cpu_adam"].lib
        fp = [dffi.cast("float *", x.data_ptr()) for x in t]

        def f_adam() -> None:
            dlib.ds_cpu_adam_step(*(dffi.cast("float *", x.data_ptr()) for x in t), 16, *scal,
                                  0, dffi.NULL, 0, 1)  # fmt: skip

        cases["adam step (n=16)"]["cffi"] = f_adam
        cases["adam step (n=16)"]["cffi, pre-cast"] = lambda: dlib.ds_cpu_adam_step(
            *fp, 16, *scal, 0, dffi.NULL, 0, 1
        )
    print(f"\nns per call, best of 5 rounds of {number} (ways interleaved in each round)")
    for case, ways in cases.items():
        best = {w: float("inf") for w in ways}
        for _ in range(5):
            for w, fn in ways.items():
                best[w] = min(best[w], timeit.timeit(fn, number=number) / number * 1e9)
        ref = best["ctypes"]
        cells = "  ".join(f"{w} {ns:7.0f} ({ns / ref:.2f}x)" for w, ns in best.items())
        print(f"{case:22} {cells}")

    print("\nload of a built library (ms, one process, first load)")
    ct = kept["shm_sync"]["ctypes (build_shared_library)"]
    started = time.perf_counter()
    ctypes.CDLL(str(ct))
    print(f"  ctypes.CDLL(shm_sync)           {1e3 * (time.perf_counter() - started):6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=100_000, help="calls per round")
    ap.add_argument("--builds", type=int, default=3, help="cold builds per helper and way")
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"cffi {cffi.__version__ if cffi else 'not installed'}")  # fmt: skip
    torch.set_num_threads(1)
    kept = bench_builds(args.builds)
    bench_calls(kept, args.number)
    if cffi is not None:
        code = (
            "import time,sys; t=time.perf_counter(); import _cffi_backend; "
            "a=time.perf_counter(); import cffi; b=time.perf_counter(); "
            "print(f'  import _cffi_backend {1e3*(a-t):6.2f}  import cffi {1e3*(b-a):6.2f}')"
        )
        print("\nimport cost in a fresh interpreter (ms)")
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    main()

"""The project's C functions (app/kernels/*.c), compiled once per CPU kind into the cache folder and called via ctypes,
which releases the GIL during a call. One C call does a piece of a decode step that would be many tiny torch calls. Each
caller keeps a torch version (tests compare the two), used where there is no compiler, the build fails (logged as an
error) or TEXTENV_NATIVE=0."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from app.paths import cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("int8_rows.c", "int8_layer.c", "attend_rows.c", "int8_mm.c"))
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("int8_rows.h", "fastmath.h", "attend_lanes.h", "attend_rows.h"))
# -ffp-contract=off: no fused multiply-adds where the torch versions round twice; -march=native: built on the CPU
# it runs on (the cache file's name holds the CPU's features)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
# threads: OpenMP, using the libgomp torch has loaded (one pool); without OpenMP the same functions single-threaded
OPENMP = "-fopenmp"

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # name: (argument types, result type), as the .c files declare them
    "split_rows": ([_p, _i64, _i64, _f32, _f32, _p, _p, _p], None),
    "combine_rows": ([_p, _p, _i64, _i64, _f32, _p, _p, _p, _p], None),
    "norm_split": ([_p, _i64, _i64, _p, _f32, _f32, _f32, _p, _p, _p], None),
    "rotate": ([_p, _i64, _i64, _i64, _i64, _p, _p], None),
    "norm_heads": ([_p, _i64, _i64, _i64, _i64, _i64, _p, _f32], None),
    "combine_add": ([_p, _p, _i64, _i64, _f32, _p, _p, _p, _p], None),
    "combine_add_norm_split": ([_p, _p, _i64, _i64, _f32, _p, _p, _p, _p, _p, _f32, _f32, _p, _p, _p], None),
    "combine_silu_split": ([_p, _p, _i64, _i64, _f32, _p, _p, _p, _f32, _p, _p, _p], None),
    "attend_fast": ([_i64, _i64, _i64], ctypes.c_int),
    "attend_batch": ([_p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _i64, _i64, _f32, _p],
                     ctypes.c_int),
    "mm_int8_available": ([], ctypes.c_int),
    "mm_int8_amx": ([], ctypes.c_int),
    "mm_int8": ([_p, _i64, _i64, _p, _p, _i64, _p], ctypes.c_int),
    "mm_int8_combined": ([_p, _i64, _i64, _p, _p, _i64, _f32, _p, _p, _p, _p], ctypes.c_int),
    "qkv_packed": ([_p, _i64, _i64, _p, _f32, _f32, _f32, _p, _i64, _i64, _p, _p, _i64, _p, _p, _f32, _p],
                   ctypes.c_int),
    "finish_packed": ([_p, _i64, _p, _p, _p, _f32, _p, _p, _f32, _f32], ctypes.c_int),
    "forward_layers": ([_p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _p, _p, _p, _i64, _f32, _f32],
                       ctypes.c_int),
}


_failures: list[str] = []  # why the last library() call's build failed, where a compiler is present


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C functions, built on first use; None where they cannot be, and callers run their torch versions. A failed
    build where a compiler is present is logged as an error (build_error)."""
    _failures.clear()
    if os.environ.get("TEXTENV_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: the per-token work runs in torch (the same model, slower)")
        return None
    try:
        path = cache_dir() / f"native-{_build_key(compiler)}.so"
        if not path.exists():
            _build(compiler, path)
        import torch  # noqa: F401  (loaded first, so the library's libgomp.so.1 is torch's: OPENMP)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        _failures.append(f"could not build the C functions with {compiler}: {_describe(error)}")
        log.error("%s\nThe per-token work runs in torch instead (the same model, slower).", _failures[-1])
        return None
    for name, (arguments, result) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


def build_error() -> str | None:
    """Why the C functions did not build where a compiler is present, with the compiler's message; None otherwise."""
    library()
    return _failures[-1] if _failures else None


def _describe(error: BaseException) -> str:
    """A failed build step as the compiler reported it: the command's status and everything it wrote."""
    if isinstance(error, subprocess.CalledProcessError):
        said = "\n".join(part.strip() for part in (error.stdout, error.stderr) if part and part.strip())
        return f"`{' '.join(map(str, error.cmd))}` exited with status {error.returncode}" + (
            f":\n{said[-MESSAGE_CHARS:]}" if said else " and wrote nothing")
    if isinstance(error, subprocess.TimeoutExpired):
        return f"`{' '.join(map(str, error.cmd))}` did not finish within {error.timeout:g} s"
    return str(error)


MESSAGE_CHARS = 4000  # the end of a compiler's message that the log and build_error keep (its errors come last)


def _build_key(compiler: str) -> str:
    """A digest of what the built library depends on: sources, compiler and flags, and the CPU's features (-march=native
    code may not run on another CPU kind)."""
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    parts = [source.read_text() for source in SOURCES + HEADERS] + [compiler, *FLAGS, OPENMP, cpu]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _build(compiler: str, path: Path) -> None:
    """Compile into a file of this process's own, then move it into place (other processes may build too)."""
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    command = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(part), "-lm"]
    try:
        try:
            subprocess.run([*command, OPENMP], check=True, capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError as error:
            log.info("building without OpenMP (%s): the int8 matmul runs on one thread", error.stderr.strip()[-200:])
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)

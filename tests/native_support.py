"""What the tests of the C functions (app/kernels/*.c, app.kernels.native) need, and the one reason they may skip.

The C library must build wherever these tests run: a failed build fails them (an error at their setup, with the
compiler's message; it used to skip them all, ~200 tests, with "no C compiler"). A test may skip only where the
machine's CPU lacks a feature its code path needs, and says which, read from /proc/cpuinfo (e.g. "needs AVX-512
VNNI: not in /proc/cpuinfo"). Where the CPU has the feature, the library built with -march=native must have taken
it: a test checks that, so a build that silently lost a path fails too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.kernels import native

# the CPU features a C path needs, as /proc/cpuinfo names them, and as a person would say them
AVX512 = {"avx512f": "AVX-512"}
VNNI = {"avx512_vnni": "AVX-512 VNNI", "avx512bw": "AVX-512 BW"}
AMX = {"amx_tile": "AMX tiles", "amx_int8": "AMX int8"}


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    line = next((line for line in lines if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def missing(*features: dict[str, str]) -> str | None:
    """The skip reason where the CPU lacks one of `features` (None where it has them all)."""
    flags = cpu_flags()
    lacking = [name for feature in features for flag, name in feature.items() if flag not in flags]
    return f"needs {', '.join(lacking)}: not in /proc/cpuinfo" if lacking else None


def needs(*features: dict[str, str]) -> pytest.MarkDecorator:
    """Skip where the CPU lacks a feature (and say which); run everywhere else."""
    reason = missing(*features)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def amx_off() -> str | None:
    """The skip reason where TEXTENV_AMX=0 keeps the tiles off (a host whose tiles misbehave: app/kernels/int8_mm.c)."""
    return "TEXTENV_AMX=0 keeps the AMX tiles off on this host" if os.environ.get("TEXTENV_AMX") == "0" else None


def needs_amx() -> pytest.MarkDecorator:
    """Skip where the CPU lacks the AMX tiles (or TEXTENV_AMX=0 keeps them off), and say which."""
    reason = missing(VNNI, AMX) or amx_off()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def c_library():
    """The built C library; fails the calling test (never skips it) where it did not build."""
    lib = native.library()
    if lib is None:
        if os.environ.get("TEXTENV_NATIVE", "1") == "0":
            why = "TEXTENV_NATIVE=0 turns them off"
        else:
            why = native.build_error() or f"no C compiler ({os.environ.get('CC', 'cc')} is not on PATH)"
        pytest.fail(f"the C functions are not available: {why}", pytrace=False)
    return lib


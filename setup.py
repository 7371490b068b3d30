"""Build script: one C extension, ``xccl._C``, from csrc/ and backends/.

What is built: the C engine (csrc/core, csrc/algo), the CPython extension (csrc/pyext) and the
two transports that exist, tcp and shm (backends/tcp, backends/shm). There is no CUDA or
libibverbs backend yet; the module needs only libc, libdl and libm, and moves CPU memory only.

Environment: ``XCCL_WERROR=0`` builds without -Werror; ``XCCL_SANITIZE=address`` (or ``1``)
builds with AddressSanitizer and UndefinedBehaviorSanitizer (every UB report is fatal). Such a
module imports only into a process that has the ASan runtime first:
``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``; tests/san/run-python.sh builds it into
build/san-py/ and runs part of the Python suite with it.
"""

import glob
import os

from setuptools import Extension, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources() -> list[str]:
    pats = ["csrc/core/*.c", "csrc/algo/*.c", "csrc/pyext/*.c", "backends/*/*.c"]
    out: list[str] = []
    for pat in pats:
        out += sorted(glob.glob(pat, root_dir=ROOT))
    return out


def _macros() -> list[tuple[str, str]]:
    macros = [("_GNU_SOURCE", "1")]
    return macros


extra = ["-std=c11", "-O2", "-g", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wshadow",
         "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
if os.environ.get("XCCL_WERROR", "1") != "0":
    extra.append("-Werror")
SANITIZE = os.environ.get("XCCL_SANITIZE", "")
if SANITIZE not in ("", "0", "1", "address"):
    raise SystemExit(f"XCCL_SANITIZE={SANITIZE!r}: expected 'address' (or 1), or unset")
SAN_FLAGS = ["-fsanitize=address,undefined"] if SANITIZE in ("1", "address") else []
if SAN_FLAGS:
    extra += SAN_FLAGS + ["-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-O1"]

ext = Extension(
    "xccl._C",
    sources=_sources(),
    include_dirs=["csrc/include", "csrc"],
    define_macros=_macros(),
    extra_compile_args=extra,
    extra_link_args=["-pthread"] + SAN_FLAGS,
    libraries=["dl", "m"],
)

setup(ext_modules=[ext])

"""Build script: one C extension, ``xccl._C``, from csrc/ and backends/.

What is built: the C engine (csrc/core, csrc/algo), the CPython extension (csrc/pyext) and the
transports: tcp and shm (backends/tcp, backends/shm) always, and ibverbs (backends/ibverbs,
RDMA) when rdma-core's header <infiniband/verbs.h> is found (Debian/Ubuntu: libibverbs-dev;
RHEL: rdma-core-devel). Without it the build leaves ibverbs out and says why. libibverbs is
never linked: the transport loads libibverbs.so.1 with dlopen when a communicator starts, so
the module needs only libc, libdl and libm, and imports on machines without the library or an
RDMA device (the transport then reports itself "not usable" and tcp/shm carry on).

Environment: ``XCCL_WERROR=0`` builds without -Werror; ``XCCL_SANITIZE=address`` (or ``1``)
builds with AddressSanitizer and UndefinedBehaviorSanitizer (every UB report is fatal). Such a
module imports only into a process that has the ASan runtime first:
``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``; tests/san/run-python.sh builds it into
build/san-py/ and runs part of the Python suite with it.
"""

import glob
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _have_ibverbs() -> tuple[bool, str]:
    """Whether the C compiler finds <infiniband/verbs.h>, and if not, why."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w", encoding="ascii") as f:
            f.write("#include <infiniband/verbs.h>\nint main(void) { return 0; }\n")
        try:
            res = subprocess.run(shlex.split(cc) + ["-E", "-o", os.devnull, src],
                                 capture_output=True, text=True, check=False)
        except OSError as e:
            return False, f"cannot run the C compiler {cc!r}: {e}"
    if res.returncode != 0:
        return False, ("<infiniband/verbs.h> not found (install libibverbs-dev, or "
                       "rdma-core-devel)")
    return True, ""


HAVE_IBVERBS, NO_IBVERBS_WHY = _have_ibverbs()
if not HAVE_IBVERBS:
    print(f"xccl: building without the ibverbs (RDMA) transport: {NO_IBVERBS_WHY}",
          file=sys.stderr)


def _sources() -> list[str]:
    pats = ["csrc/core/*.c", "csrc/algo/*.c", "csrc/pyext/*.c", "backends/*/*.c"]
    out: list[str] = []
    for pat in pats:
        out += sorted(glob.glob(pat, root_dir=ROOT))
    if not HAVE_IBVERBS:
        out = [s for s in out if not s.startswith("backends/ibverbs/")]
    return out


def _macros() -> list[tuple[str, str]]:
    macros = [("_GNU_SOURCE", "1")]
    if not HAVE_IBVERBS:
        macros.append(("XCCL_NO_IBVERBS", "1"))
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

"""Build script: one C extension, ``xccl._C``, from csrc/ and backends/.

What is built: the C engine (csrc/core, csrc/algo), the CPython extension (csrc/pyext) and the
transports: tcp and shm (backends/tcp, backends/shm) always, and ibverbs (backends/ibverbs,
RDMA) when rdma-core's header <infiniband/verbs.h> is found (Debian/Ubuntu: libibverbs-dev;
RHEL: rdma-core-devel). Without it the build leaves ibverbs out and says why. libibverbs is
never linked: the transport loads libibverbs.so.1 with dlopen when a communicator starts, so
the module needs only libc, libdl and libm, and imports on machines without the library or an
RDMA device (the transport then reports itself "not usable" and tcp/shm carry on).

CUDA (csrc/cuda: the device layer, the executor of device memory; backends/cuda_ipc) is built
when <cuda.h> is found: in $CUDA_HOME, $CUDA_PATH or /usr/local/cuda (each's include/), or in
../include of the directory holding nvcc (on PATH). The GPU kernels (csrc/cuda/kernels.cu) need
nvcc too: csrc/cuda/build_fatbin.py compiles them into one fatbin (SASS for every architecture
nvcc supports from sm_75 up, PTX for the newest; ``XCCL_CUDA_ARCHS="90"`` or ``"75;90"``
compiles only those), cached in build/cuda-fatbin/ by a hash of its inputs, and embedded in the
module. Without the headers CUDA is left out, and without nvcc the kernels are; the build says
why, and so does ``xccl_cuda_info`` at run time. libcuda is never linked (loaded with dlopen
when a process chooses its GPU) and libcudart is not used.

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


def _find_cuda() -> tuple[str | None, str | None, str]:
    """(the include directory holding cuda.h, nvcc, why not) - the first two None when absent."""
    sys.path.insert(0, os.path.join(ROOT, "csrc", "cuda"))
    try:
        import build_fatbin
    finally:
        sys.path.pop(0)
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    explicit = [h for h in homes if h]
    candidates = explicit if explicit else ["/usr/local/cuda"]
    nvcc = build_fatbin.find_nvcc(candidates[0])
    dirs = [os.path.join(h, "include") for h in candidates]
    if nvcc is not None and not explicit:
        dirs.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                                 "include"))
    inc = next((d for d in dirs if os.path.isfile(os.path.join(d, "cuda.h"))), None)
    if inc is None:
        where = ", ".join(dirs)
        return None, None, f"<cuda.h> not found (looked in {where}; set CUDA_HOME)"
    if nvcc is None:
        return inc, None, ""
    return inc, nvcc, ""


CUDA_INC, NVCC, NO_CUDA_WHY = _find_cuda()
CUDA_EMBED, CUDA_ARCHS = None, ""
if CUDA_INC is None:
    print(f"xccl: building without CUDA: {NO_CUDA_WHY}", file=sys.stderr)
elif NVCC is None:
    NO_CUDA_WHY = f"nvcc not found (CUDA headers in {CUDA_INC}): built without the GPU kernels"
    print(f"xccl: {NO_CUDA_WHY}", file=sys.stderr)
else:
    sys.path.insert(0, os.path.join(ROOT, "csrc", "cuda"))
    import build_fatbin

    sys.path.pop(0)
    CUDA_EMBED, CUDA_ARCHS = build_fatbin.build(NVCC)


def _sources() -> list[str]:
    pats = ["csrc/core/*.c", "csrc/algo/*.c", "csrc/pyext/*.c", "csrc/cuda/*.c", "backends/*/*.c"]
    out: list[str] = []
    for pat in pats:
        out += sorted(glob.glob(pat, root_dir=ROOT))
    if not HAVE_IBVERBS:
        out = [s for s in out if not s.startswith("backends/ibverbs/")]
    if CUDA_INC is None:
        out = [s for s in out if not s.startswith(("csrc/cuda/", "backends/cuda_ipc/"))
               or s == "csrc/cuda/cuda_stub.c"]
    if CUDA_EMBED is not None:
        out.append(os.path.relpath(CUDA_EMBED, ROOT))
    return out


def _macros() -> list[tuple[str, str]]:
    macros = [("_GNU_SOURCE", "1")]
    if not HAVE_IBVERBS:
        macros.append(("XCCL_NO_IBVERBS", "1"))
    if CUDA_INC is not None:
        macros.append(("XCCL_HAVE_CUDA", "1"))
    if NO_CUDA_WHY:
        # a C string literal: the reason has no quote or backslash
        macros.append(("XCCL_CUDA_WHY", '"' + NO_CUDA_WHY.replace('"', "'") + '"'))
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
    include_dirs=["csrc/include", "csrc"] + ([CUDA_INC] if CUDA_INC else []),
    define_macros=_macros(),
    extra_compile_args=extra,
    extra_link_args=["-pthread"] + SAN_FLAGS,
    libraries=["dl", "m"],
    depends=[CUDA_EMBED] if CUDA_EMBED else [],
)

setup(ext_modules=[ext])

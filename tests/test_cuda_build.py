"""The build of the GPU kernels (csrc/cuda/build_fatbin.py), without nvcc or a GPU.

A stand-in nvcc (a shell script) answers the architecture queries and "compiles" by writing a
file, so these tests check the architecture list (nvcc's, or XCCL_CUDA_ARCHS), the cache (one
compilation per set of inputs, a new one when an input changes) and the embedding C file, which
gcc compiles and links into a program that reads the image back.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "xccl_build_fatbin", ROOT / "csrc" / "cuda" / "build_fatbin.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_nvcc(tmp: Path, codes: str = "sm_50 sm_75 sm_90 sm_90a sm_100",
               list_code: bool = True) -> Path:
    """A script that lists `codes` and writes 'fatbin:<args>' to the -o file, counting calls."""
    nvcc = tmp / "nvcc"
    code_case = f'  --list-gpu-code) echo "{codes}" | tr " " "\\n"; exit 0 ;;' if list_code \
        else '  --list-gpu-code) exit 1 ;;'
    arch = codes.replace("sm_", "compute_")
    nvcc.write_text(f"""#!/bin/sh
case "$1" in
{code_case}
  --list-gpu-arch) echo "{arch}" | tr " " "\\n"; exit 0 ;;
  --version) echo "fake nvcc 1.0"; exit 0 ;;
esac
echo x >> "{tmp}/calls"
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; shift; fi
  shift
done
printf 'FATBIN-IMAGE' > "$out"
""")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return nvcc


def _calls(tmp: Path) -> int:
    p = tmp / "calls"
    return len(p.read_text().split()) if p.exists() else 0


def test_arch_list_from_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SASS for every listed sm_ from 75 up (suffixed ones left out), PTX for the newest."""
    bf = _load()
    monkeypatch.delenv("XCCL_CUDA_ARCHS", raising=False)
    archs = bf.arch_list(str(_fake_nvcc(tmp_path)))
    assert archs == [75, 90, 100]
    assert bf.archs_string(archs) == "sm_75 sm_90 sm_100 compute_100"
    # an nvcc without --list-gpu-code: its --list-gpu-arch
    other = tmp_path / "other"
    other.mkdir()
    assert bf.arch_list(str(_fake_nvcc(other, "sm_70 sm_80 sm_89", False))) == [80, 89]


def test_arch_list_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XCCL_CUDA_ARCHS overrides nvcc's list; nonsense is refused with a message."""
    bf = _load()
    nvcc = str(_fake_nvcc(tmp_path))
    for env, want in [("90", [90]), ("75;90", [75, 90]), ("sm_90, 80", [80, 90])]:
        monkeypatch.setenv("XCCL_CUDA_ARCHS", env)
        assert bf.arch_list(nvcc) == want
    for bad in ["abc", ";;"]:
        monkeypatch.setenv("XCCL_CUDA_ARCHS", bad)
        with pytest.raises(SystemExit, match="XCCL_CUDA_ARCHS"):
            bf.arch_list(nvcc)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_cache_and_embedding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One compilation per input set; the embedding C file links and holds the image."""
    bf = _load()
    monkeypatch.setattr(bf, "ROOT", str(tmp_path))  # the cache: tmp_path/build/cuda-fatbin
    monkeypatch.setenv("XCCL_CUDA_ARCHS", "75;90")
    nvcc = str(_fake_nvcc(tmp_path))
    embed, archs = bf.build(nvcc, quiet=True)
    assert archs == "sm_75 sm_90 compute_90"
    assert _calls(tmp_path) == 1
    assert bf.build(nvcc, quiet=True) == (embed, archs)  # cached: nvcc not run again
    assert _calls(tmp_path) == 1
    monkeypatch.setenv("XCCL_CUDA_ARCHS", "90")  # another input: another fatbin
    embed2, _ = bf.build(nvcc, quiet=True)
    assert embed2 != embed and _calls(tmp_path) == 2
    main = tmp_path / "main.c"
    main.write_text("""#include <stdio.h>
#include <stdint.h>
extern const unsigned char xccl_cuda_fatbin[];
extern const size_t xccl_cuda_fatbin_size;
extern const char xccl_cuda_archs[];
int main(void)
{
    printf("%zu %.*s %s %d\\n", xccl_cuda_fatbin_size, (int)xccl_cuda_fatbin_size,
           (const char *)xccl_cuda_fatbin, xccl_cuda_archs,
           (int)((uintptr_t)xccl_cuda_fatbin % 16));
    return 0;
}
""")
    exe = tmp_path / "main"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-o", str(exe), str(main), embed],
                   check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["12", "FATBIN-IMAGE", "sm_75", "sm_90", "compute_90", "0"]


def test_script_without_nvcc(tmp_path: Path) -> None:
    """Run alone without nvcc, the script says what is missing."""
    env = dict(os.environ, CUDA_HOME=str(tmp_path), PATH=str(tmp_path))
    env.pop("NVCC", None)
    res = subprocess.run([sys.executable, str(ROOT / "csrc" / "cuda" / "build_fatbin.py")],
                         capture_output=True, text=True, env=env, check=False)
    assert res.returncode != 0
    assert "nvcc not found" in res.stderr

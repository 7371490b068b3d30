"""The fuzz harnesses of tests/fuzz without clang: every committed seed and every regression
input (inputs that once crashed or broke a check, kept after the fix) replayed through each
harness built by the system C compiler, and the seed corpus checked against its generator.

The fuzzing itself (libFuzzer, ASan/UBSan, a fixed time per harness) is tests/fuzz/run.sh.
"""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "tests", "fuzz")


def _harnesses() -> list[str]:
    return sorted(f[len("fuzz_"):-2] for f in os.listdir(FUZZ)
                  if f.startswith("fuzz_") and f.endswith(".c"))


def _count(d: str) -> int:
    return len(os.listdir(d)) if os.path.isdir(d) else 0


def test_every_harness_replays_its_corpus_and_regressions() -> None:
    """Builds each harness with replay_main.c and runs every input once: no crash, no failed
    check, and exactly the inputs on disk were replayed."""
    r = subprocess.run(["make", "-s", "-C", FUZZ, "replay"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"replay failed:\n{r.stdout}\n{r.stderr}"
    replayed = {m.group(1): int(m.group(2))
                for m in re.finditer(r"^(\w+) replay: (\d+) inputs$", r.stdout, re.M)}
    harnesses = _harnesses()
    assert len(harnesses) >= 8
    for h in harnesses:
        want = _count(os.path.join(FUZZ, "corpus", h)) + _count(os.path.join(FUZZ, "regress", h))
        assert _count(os.path.join(FUZZ, "corpus", h)) > 0, f"{h}: no seed corpus committed"
        assert replayed.get(h) == want, f"{h}: replayed {replayed.get(h)} inputs, {want} on disk"


def test_committed_corpus_is_what_make_corpus_writes(tmp_path: os.PathLike[str]) -> None:
    """The seeds are generated, never edited by hand: regenerating gives the same files."""
    out = os.path.join(str(tmp_path), "corpus")
    subprocess.run([sys.executable, os.path.join(FUZZ, "make_corpus.py"), "--out", out],
                   check=True, capture_output=True, timeout=60)
    for h in sorted(os.listdir(out)):
        cmp = filecmp.dircmp(os.path.join(out, h), os.path.join(FUZZ, "corpus", h))
        assert not (cmp.left_only or cmp.right_only or cmp.diff_files), (
            f"corpus/{h} differs from make_corpus.py: only generated {cmp.left_only}, only "
            f"committed {cmp.right_only}, different {cmp.diff_files}")
        _, mismatch, errors = filecmp.cmpfiles(os.path.join(out, h),
                                               os.path.join(FUZZ, "corpus", h),
                                               sorted(os.listdir(os.path.join(out, h))),
                                               shallow=False)
        assert not mismatch and not errors, f"corpus/{h}: {mismatch + errors} differ"

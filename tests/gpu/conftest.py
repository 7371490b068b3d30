"""tests/gpu: correctness of xccl's Python API on CUDA tensors (2, 3 and 4 ranks sharing
GPU 0). Every test here is marked ``gpu``; without a GPU (torch without CUDA, no driver, or
an xccl built without CUDA) the whole directory is skipped with the reason.

    python -m pytest -m gpu tests/gpu -q
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu; skipped without one)")


@lru_cache(maxsize=1)
def gpu_skip_reason() -> Optional[str]:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU tests use torch CUDA tensors)"
    if not torch.cuda.is_available():
        return f"no GPU: torch.cuda.is_available() is False (torch {torch.__version__})"
    import xccl.cuda

    if not xccl.cuda.is_available():
        why = xccl.cuda.build_info()["why"] or "the driver sees no device"
        return f"xccl.cuda is not available: {why}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(Path(__file__).resolve().parent)
    mine = [item for item in items if str(item.path).startswith(here)]
    if not mine:
        return
    reason = gpu_skip_reason()
    for item in mine:
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))

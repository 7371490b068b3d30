"""Teaching and observability helpers: cost model and explain, benchmarks with α-β fits, and
pictures of traces, schedules and buffers.

    xccl.explain("all_reduce", 1 << 20, size=8)     # predicted cost of every algorithm
    r = xccl.teach.bench("all_reduce", algos=["ring", "rd"], nprocs=4)
    r.fit(); r.plot()                                # α, β per transport; measured vs model

``python -m xccl.teach.figures --out docs/img`` draws the README's pictures.
"""

from __future__ import annotations

from .bench import BenchResult, bench, busbw_factor, fit_model
from .model import Explanation, Model, canonical_collective, crossovers, explain, predict
from .plots import plot_buffers, plot_predicted, plot_schedule, plot_timeline

__all__ = [
    "BenchResult",
    "Explanation",
    "Model",
    "bench",
    "busbw_factor",
    "canonical_collective",
    "crossovers",
    "explain",
    "fit_model",
    "plot_buffers",
    "plot_predicted",
    "plot_schedule",
    "plot_timeline",
    "predict",
]

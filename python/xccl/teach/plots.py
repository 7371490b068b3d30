"""Pictures (matplotlib, imported only when a picture is asked for): per-rank timelines and
algorithm schedules from trace records, buffers before/after a collective, and measured
against predicted costs."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["plot_bench", "plot_buffers", "plot_predicted", "plot_schedule", "plot_timeline"]

KIND_COLORS = {
    "send": "#1f77b4",
    "recv": "#ff7f0e",
    "reduce": "#2ca02c",
    "span": "#7f7f7f",
    "work": "#9467bd",
}
_STEP_KINDS = ("send", "recv", "reduce")
# Vertical place of each kind inside a rank's row (row height 1, rank 0 at the top).
_OP_LANE = -0.45
_OP_SHADES = ("#8c8c8c", "#c8c8c8")
_LANE = {"work": -0.31, "span": -0.16, "send": 0.0, "recv": 0.15, "reduce": 0.3}
_LANE_H = 0.12


def _plt() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("xccl's plots need matplotlib (pip install matplotlib)") from None
    return plt


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s < 2e-3:
        return 1e6, "µs"
    if span_s < 2.0:
        return 1e3, "ms"
    return 1.0, "s"


# ---------------------------------------------------------------------------------------------
# Timeline
# ---------------------------------------------------------------------------------------------


def plot_timeline(
    records: Sequence[dict[str, Any]],
    ax: Any = None,
    group: Optional[str] = None,
    title: Optional[str] = None,
) -> Any:
    """One row per rank: sends, receives and reductions as bars in their own lanes, user
    spans and async Works above them (a Work's wait between enqueue and start is hatched),
    and at the top of the row each operation's extent on that rank (alternating shades)."""
    plt = _plt()
    from matplotlib.patches import Patch

    recs = [r for r in records if group is None or r["group"] in (group, "")]
    if not recs:
        raise ValueError("plot: no records to draw")
    ranks = sorted({r["rank"] for r in recs})
    row = {rank: i for i, rank in enumerate(ranks)}
    t_lo = min(r.get("enqueue", r["start"]) for r in recs)
    t_hi = max(r["end"] for r in recs)
    scale, unit = _time_unit(max(t_hi - t_lo, 1e-9))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.8 * len(ranks) + 1.3))
    min_w = (t_hi - t_lo) * scale / 1500  # so that instants stay visible
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for r in recs:
        bars[(r["rank"], r["kind"])].append(
            (r["start"] * scale, max((r["end"] - r["start"]) * scale, min_w)))
    for (rank, kind), xs in bars.items():
        y = row[rank] + _LANE[kind] - _LANE_H / 2
        ax.broken_barh(xs, (y, _LANE_H), facecolors=KIND_COLORS[kind], edgecolor="none")
    for r in recs:
        if r["kind"] == "work" and r.get("enqueue") is not None and r["start"] > r["enqueue"]:
            y = row[r["rank"]] + _LANE[r["kind"]] - _LANE_H / 2
            ax.broken_barh([(r["enqueue"] * scale, (r["start"] - r["enqueue"]) * scale)],
                           (y, _LANE_H), facecolors="none", edgecolor=KIND_COLORS["work"],
                           hatch="///", linewidth=0.5)
        if r["kind"] in ("span", "work") and r.get("name"):
            ax.text(r["end"] * scale, row[r["rank"]] + _LANE[r["kind"]], f" {r['name']}",
                    fontsize=7, va="center", ha="left", clip_on=True)
    # Above each rank's steps: the extent of each operation on that rank (its first step's
    # start to its last step's end), in alternating shades, named when there is room.
    extents: dict[tuple[int, str, int], list[Any]] = {}
    for r in recs:
        if r["kind"] in _STEP_KINDS:
            e = extents.setdefault((r["rank"], r["group"], r["seq"]), [r["start"], r["end"], r])
            e[0], e[1] = min(e[0], r["start"]), max(e[1], r["end"])
    order = {key: i for i, key in enumerate(sorted({k[1:] for k in extents}))}
    for (rank, grp, seq), (lo, hi, first) in extents.items():
        y = row[rank] + _OP_LANE
        shade = _OP_SHADES[order[(grp, seq)] % 2]
        ax.broken_barh([(lo * scale, max((hi - lo) * scale, min_w))], (y - 0.035, 0.07),
                       facecolors=shade, edgecolor="none")
        if (hi - lo) > 0.07 * (t_hi - t_lo):
            ax.text(lo * scale, y - 0.05, f"{first['op']} ({first['algo']})", fontsize=6.5,
                    va="bottom", ha="left", color="#333333")
    ax.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.62)
    ax.set_xlabel(f"time since the trace began ({unit})")
    kinds = [k for k in KIND_COLORS if any(r["kind"] == k for r in recs)]
    names = {"send": "send", "recv": "receive (posted to done)", "reduce": "reduce",
             "span": "user span", "work": "async Work"}
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=names[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(kinds), fontsize=8,
              frameon=False)
    if title is None:
        ops = sorted({(r["seq"], r["op"], r["algo"]) for r in recs if r["kind"] in _STEP_KINDS})
        names_ops = ", ".join(dict.fromkeys(f"{o} ({a})" for _, o, a in ops))
        title = f"timeline: {names_ops}" if names_ops else "timeline"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------


def _pick_operation(
    records: Sequence[dict[str, Any]], seq: Optional[int], group: Optional[str],
    op: Optional[str],
) -> list[dict[str, Any]]:
    per_op: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["kind"] in _STEP_KINDS:
            per_op[(r["group"], r["seq"])].append(r)
    cands = []
    for (g, s), recs in per_op.items():
        if seq is not None and s != seq:
            continue
        if group is not None and g != group:
            continue
        if op is not None and recs[0]["op"] != op:
            continue
        if not any(r["kind"] == "send" for r in recs):
            continue
        cands.append(recs)
    if not cands:
        raise ValueError(f"plot_schedule: no traced operation with messages matches "
                         f"seq={seq} group={group} op={op}")
    cands.sort(key=lambda rs: (rs[0]["op"] in ("send", "recv"), min(r["start"] for r in rs)))
    return cands[0]


def chunk_label(offset: int, nbytes: int, unit: int) -> tuple[str, int]:
    """("c3", 3) for a message of one chunk at chunk 3, ("c2-3", 2) for two chunks."""
    if unit <= 0:
        return (f"@{offset}", 0)
    a, k = offset // unit, max(1, nbytes // unit)
    return (f"c{a}" if k == 1 else f"c{a}-{a + k - 1}", a)


def plot_schedule(
    records: Sequence[dict[str, Any]],
    seq: Optional[int] = None,
    group: Optional[str] = None,
    op: Optional[str] = None,
    max_steps: int = 16,
    title: Optional[str] = None,
    ncols: Optional[int] = None,
) -> Any:
    """One panel per algorithm step of one operation: ranks on a circle, an arrow per
    message labelled and coloured by the chunk it carries; ranks that reduced in the step
    are filled. Returns the Figure."""
    plt = _plt()
    from matplotlib.patches import Circle

    from ..trace import chunk_unit

    recs = _pick_operation(records, seq, group, op)
    sends = [r for r in recs if r["kind"] == "send"]
    steps = sorted({r["step"] for r in sends})
    shown = steps[:max_steps]
    ranks = sorted({r["rank"] for r in recs} | {r["src"] for r in sends} |
                   {r["dst"] for r in sends})
    n = len(ranks)
    pos = {rank: (math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n))
           for i, rank in enumerate(ranks)}
    unit = chunk_unit(sends)
    cmap = plt.get_cmap("tab10")
    reduced = {(r["rank"], r["step"]) for r in recs if r["kind"] == "reduce"}
    ncols = ncols or min(len(shown), 6 if n <= 8 else 4)
    nrows = math.ceil(len(shown) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.5 * ncols, 2.6 * nrows + 0.6),
                             squeeze=False)
    node_r = 0.16 if n <= 8 else 0.1
    for ax, step in zip(axes.flat, shown, strict=False):
        for rank in ranks:
            x, y = pos[rank]
            filled = (rank, step) in reduced
            ax.add_patch(Circle((x, y), node_r, facecolor="#c7e9c0" if filled else "white",
                                edgecolor="black", linewidth=1, zorder=3))
            ax.text(x, y, str(rank), ha="center", va="center", fontsize=9, zorder=4)
        for s in (r for r in sends if r["step"] == step):
            if s["src"] not in pos or s["dst"] not in pos or s["src"] == s["dst"]:
                continue
            (x0, y0), (x1, y1) = pos[s["src"]], pos[s["dst"]]
            label, idx = chunk_label(int(s["offset"]), int(s["nbytes"]), unit)
            color = cmap(idx % 10)
            rad = 0.18
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=2,
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.6,
                                    "shrinkA": 11, "shrinkB": 11,
                                    "connectionstyle": f"arc3,rad={rad}"})
            # The label sits on matplotlib's arc3 curve (a quadratic Bezier through the control
            # point cx, cy), nearer the sender so that crossing messages keep apart.
            cx = (x0 + x1) / 2 + rad * (y1 - y0)
            cy = (y0 + y1) / 2 - rad * (x1 - x0)
            u = 0.32
            mx = (1 - u) ** 2 * x0 + 2 * (1 - u) * u * cx + u * u * x1
            my = (1 - u) ** 2 * y0 + 2 * (1 - u) * u * cy + u * u * y1
            ax.text(mx, my, label, fontsize=7, color=color, ha="center", va="center",
                    zorder=5, bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none",
                                    "alpha": 0.8})
        ax.set_title(f"step {step}", fontsize=9)
        ax.set_xlim(-1.35, 1.35)
        ax.set_ylim(-1.35, 1.35)
        ax.set_aspect("equal")
        ax.axis("off")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    first = recs[0]
    total = sum(int(s["nbytes"]) for s in sends)
    more = f" (first {len(shown)} of {len(steps)} steps)" if len(shown) < len(steps) else ""
    unit_txt = f"; chunk c = {unit} B" if unit else ""
    fig.suptitle(title or f"{first['op']} ({first['algo']}) on {n} ranks: {len(sends)} "
                 f"messages, {total} B sent{unit_txt}{more}", fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------


def plot_buffers(
    panels: dict[str, Sequence[Sequence[float]]],
    title: Optional[str] = None,
    fmt: str = "{:g}",
    cmap: str = "viridis",
    axes: Any = None,
) -> Any:
    """Side-by-side pictures of per-rank buffers, e.g. ``{"before": [...], "after": [...]}``
    where each value holds one 1-D buffer per rank (lengths may differ; None is a buffer
    the operation leaves undefined on that rank). Each panel is a grid, one row per rank and
    one cell per element, coloured by value and labelled with it. Returns the Figure."""
    plt = _plt()
    import numpy as np

    names = list(panels)
    widths = []
    for name in names:
        bufs = [b for b in panels[name] if b is not None]
        widths.append(max([len(np.atleast_1d(np.asarray(b))) for b in bufs] + [1]))
    nranks = max(len(panels[n]) for n in names)
    vals = [float(v) for n in names for b in panels[n] if b is not None
            for v in np.atleast_1d(np.asarray(b, dtype=float))]
    vmin, vmax = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if axes is None:
        fig, axes = plt.subplots(1, len(names), figsize=(sum(0.45 * w + 1.0 for w in widths),
                                                         0.45 * nranks + 1.2),
                                 gridspec_kw={"width_ratios": widths}, squeeze=False)
        axes = axes[0]
    fig = axes[0].figure
    for ax, name, w in zip(axes, names, widths, strict=True):
        grid = np.full((nranks, w), np.nan)
        for r, b in enumerate(panels[name]):
            if b is not None:
                a = np.atleast_1d(np.asarray(b, dtype=float))
                grid[r, : len(a)] = a
        ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1,
                  aspect="auto")
        for r in range(nranks):
            if r >= len(panels[name]) or panels[name][r] is None:
                ax.text((w - 1) / 2, r, "(undefined)", ha="center", va="center", fontsize=8,
                        color="#888888")
                continue
            for c in range(w):
                if not np.isnan(grid[r, c]):
                    v = grid[r, c]
                    light = (v - vmin) / ((vmax - vmin) or 1) > 0.6
                    ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=8,
                            color="black" if light else "white")
        ax.set_yticks(range(nranks), [f"rank {r}" for r in range(nranks)])
        ax.set_xticks([])
        ax.set_title(name, fontsize=10)
        for spine in ax.spines.values():
            spine.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Costs
# ---------------------------------------------------------------------------------------------


def _bytes_axis(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, _pos: Any) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if v < 1024:
                return f"{v:g} {unit}"
            v /= 1024
        return f"{v:g} TiB"

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(fmt))


def plot_predicted(
    collective: str,
    size: int,
    sizes: Optional[Sequence[int]] = None,
    model: Any = None,
    algos: Optional[Sequence[str]] = None,
    ax: Any = None,
    title: Optional[str] = None,
) -> Any:
    """Predicted time per algorithm against buffer size (log-log) with the crossovers marked
    and the latency-bound / bandwidth-bound regimes shaded. Returns the Axes."""
    plt = _plt()
    from .model import _as_model, _fmt_bytes, canonical_collective, crossovers, predict

    coll = canonical_collective(collective)
    m = _as_model(model)
    sizes = list(sizes or [int(2 ** (k / 4)) for k in range(0, 4 * 26 + 1)])
    rows = predict(coll, sizes, size, m, algos)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    by_algo: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r["applicable"]:
            by_algo[r["algo"]].append((r["size"], r["predicted_s"]))
    for algo, pts in by_algo.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=algo, lw=1.8)
    if m.beta > 0:  # where the α and β terms of one message are equal
        knee = m.alpha / m.beta
        top = max(r["predicted_s"] for r in rows)
        ax.axvspan(min(sizes), knee, color="#dddddd", alpha=0.35, lw=0)
        ax.axvline(knee, color="#999999", lw=0.8)
        ax.text(min(sizes) * 1.3, top * 0.5, "← latency-bound", fontsize=8, color="#555555")
        ax.text(knee * 1.3, top * 0.5, f"bandwidth-bound →\n(α/β = {_fmt_bytes(knee)})",
                fontsize=8, color="#555555")
    for n, a, b in crossovers(coll, size, m, algos, lo=min(sizes), hi=max(sizes)):
        ax.axvline(n, color="black", ls="--", lw=0.9)
        ax.annotate(f"crossover\n{a} → {b}\nat {_fmt_bytes(n)}", (n, 0.02),
                    xycoords=("data", "axes fraction"), xytext=(4, 0),
                    textcoords="offset points", fontsize=7)
    _bytes_axis(ax)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size")
    ax.set_ylabel("predicted time (s)")
    ax.set_title(title or f"{coll} on {size} ranks, {m}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.figure.tight_layout()
    return ax


def plot_bench(
    result: Any,
    ax: Any = None,
    transport: Optional[str] = None,
    model: Any = None,
    title: Optional[str] = None,
    measured_crossovers: Optional[bool] = None,
) -> Any:
    """Measured (points) against predicted (lines) per algorithm, log-log, the predicted
    crossovers as dashed lines and the measured ones as dotted red lines. Measured
    crossovers are shown when asked, or (None) when there are no more of them than
    predicted ones plus one: noisy measurements cross back and forth, which says nothing.
    Returns the Axes."""
    plt = _plt()
    from .bench import fit_model
    from .model import _fmt_bytes

    rows = result._select(transport)
    t = rows[0]["transport"]
    m = model or fit_model(rows)
    lo = min(r["size"] for r in rows)
    hi = max(r["size"] for r in rows)
    dense = sorted({max(1, int(2 ** (k / 8))) for k in
                    range(int(8 * math.log2(max(lo, 1))), int(8 * math.log2(max(hi, 2))) + 1)})
    pred = result.predicted(m, t, dense)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    cmap = plt.get_cmap("tab10")
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    for i, algo in enumerate(algos):
        c = cmap(i % 10)
        pts = sorted((r["size"], r["time"]) for r in rows if r["algo"] == algo)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=c, ms=5,
                label=f"{algo} measured")
        line = [(r["size"], r["predicted_s"]) for r in pred if r["algo"] == algo]
        ax.plot([p[0] for p in line], [p[1] for p in line], "-", color=c, lw=1.5, alpha=0.8,
                label=f"{algo} predicted")
    cross = result.crossovers(m, t)
    for n, a, b in cross["predicted"]:
        ax.axvline(n, color="black", ls="--", lw=0.9)
        ax.annotate(f"predicted crossover\n{a} → {b} at {_fmt_bytes(n)}", (n, 0.02),
                    xycoords=("data", "axes fraction"), xytext=(4, 0),
                    textcoords="offset points", fontsize=7)
    show = measured_crossovers
    if show is None:
        show = len(cross["measured"]) <= len(cross["predicted"]) + 1
    for n, a, b in cross["measured"] if show else []:
        ax.axvline(n, color="#d62728", ls=":", lw=1.2)
        ax.annotate(f"measured\n{a} → {b}", (n, 0.98), xycoords=("data", "axes fraction"),
                    xytext=(4, -2), textcoords="offset points", fontsize=7, va="top",
                    color="#d62728")
    _bytes_axis(ax)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (nccl-tests size)")
    ax.set_ylabel("time per operation (s)")
    fit_txt = f"fit over {t}: {m}" if m.source == "fit" else f"model: {m}"
    if m.rel_error is not None:
        fit_txt += f"; median error {m.rel_error:.0%}"
    ax.set_title(title or f"{rows[0]['op']} on {rows[0]['nranks']} ranks: measured vs "
                 f"predicted\n{fit_txt}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    ax.figure.tight_layout()
    return ax

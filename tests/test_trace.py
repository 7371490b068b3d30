"""Tracing, the flight recorder, explain, the α-β fit and the pictures.

Real runs check the recorded schedule of a ring all-reduce against the ring's definition
(rank r sends to r+1; in every step each chunk travels exactly once); the model checks
compare with formulas written out here; the pictures are drawn from real and synthetic
records with matplotlib's Agg backend."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import xccl
from xccl import _C
from xccl.debug import parse_flight, waits_table
from xccl.launch import launch
from xccl.teach import BenchResult, Model, bench, crossovers, explain, fit_model, predict
from xccl.trace import Trace, chunk_unit, trace

P = 4
COUNT = 16  # float32: 64 bytes, chunks of 16 bytes


def _traced(algo, count=COUNT):
    x = np.arange(count, dtype=np.float32) + xccl.get_rank()
    with trace() as t:
        xccl.all_reduce(x, algo=algo)
        with t.span("compute"):
            np.ones(100).sum()
        w = t.record_work(xccl.all_reduce(np.ones(8, np.float32), async_op=True))
        w.wait()
    comm = xccl.distributed.group.WORLD.comm
    xccl.all_reduce(np.ones(8, np.float32))
    left_on = comm.trace_drain()  # recording stopped with the block
    expected = np.arange(count, dtype=np.float32) * P + sum(range(P))
    return {"ok": bool(np.array_equal(x, expected)), "records": t.to_records(),
            "left_on": left_on, "n": len(t), "ranks": t.ranks}


@pytest.fixture(scope="module")
def ring():
    return launch(_traced, P, "ring")


def test_gathered_to_rank_zero(ring):
    assert all(r["ok"] for r in ring)
    assert all(r["left_on"] == [] for r in ring)
    recs = ring[0]["records"]
    assert ring[0]["ranks"] == list(range(P))
    assert {r["rank"] for r in recs} == set(range(P))
    for other in ring[1:]:  # the others keep their own records
        assert {r["rank"] for r in other["records"]} == {other["ranks"][0]}
        assert other["n"] == sum(1 for r in recs if r["rank"] == other["ranks"][0])
    for r in recs:
        assert r["end"] >= r["start"] >= 0
        assert set(r) >= {"op", "algo", "step", "src", "dst", "offset", "nbytes", "start",
                          "end", "transport", "kind", "rank", "seq", "group"}


def test_ring_schedule_follows_the_ring(ring):
    recs = [r for r in ring[0]["records"] if r["seq"] == 0 and r["kind"] in ("send", "recv")]
    sends = [r for r in recs if r["kind"] == "send"]
    assert {r["algo"] for r in recs} == {"ring"} and {r["op"] for r in recs} == {"all_reduce"}
    assert len(sends) == P * 2 * (P - 1)  # 2(p-1) steps, one message per rank per step
    unit = chunk_unit(sends)
    assert unit == COUNT * 4 // P
    by_step = {}
    for s in sends:
        assert s["dst"] == (s["src"] + 1) % P and s["rank"] == s["src"]
        assert s["nbytes"] == unit and s["buf"] in ("send", "recv")
        by_step.setdefault(s["step"], []).append(s["offset"] // unit)
    assert len(by_step) == 2 * (P - 1)
    for chunks in by_step.values():  # every chunk moves exactly once per step
        assert sorted(chunks) == list(range(P))
    recvs = [r for r in recs if r["kind"] == "recv"]
    assert sorted((r["src"], r["dst"], r["step"]) for r in recvs) == sorted(
        (s["src"], s["dst"], s["step"]) for s in sends)
    reduces = [r for r in ring[0]["records"] if r["seq"] == 0 and r["kind"] == "reduce"]
    assert sorted(r["rank"] for r in reduces) == sorted(list(range(P)) * (P - 1))
    assert all(r["step"] < P - 1 for r in reduces)  # reductions happen in reduce-scatter


def test_spans_and_works(ring):
    recs = ring[0]["records"]
    spans = [r for r in recs if r["kind"] == "span"]
    works = [r for r in recs if r["kind"] == "work"]
    assert sorted(r["rank"] for r in spans) == list(range(P))
    assert all(r["name"] == "compute" for r in spans)
    assert sorted(r["rank"] for r in works) == list(range(P))
    for w in works:
        assert w["op"] == "all_reduce" and w["enqueue"] <= w["start"] <= w["end"]


def test_operations_and_dataframe(ring):
    t = Trace.from_records(ring[0]["records"])
    ops = t.operations()
    assert [(o["seq"], o["algo"]) for o in ops][:1] == [(0, "ring")]
    assert ops[0]["messages"] == P * 2 * (P - 1) and ops[0]["ranks"] == list(range(P))
    pd = pytest.importorskip("pandas")
    df = t.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == len(t)


def test_perfetto(ring, tmp_path):
    t = Trace.from_records(ring[0]["records"])
    path = t.to_perfetto(tmp_path / "t.json")
    doc = json.loads(open(path).read())
    ev = doc["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(P)}
    slices = [e for e in ev if e["ph"] == "X" and e["cat"] == "send"]
    assert len(slices) == sum(1 for r in t if r["kind"] == "send")
    starts = [e for e in ev if e["ph"] == "s"]
    ends = [e for e in ev if e["ph"] == "f"]
    assert len(starts) == len(ends) >= P * 2 * (P - 1)
    assert all(e["dur"] >= 0 for e in ev if e["ph"] == "X")


def test_pictures(ring, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    t = Trace.from_records(ring[0]["records"])
    fig = t.plot_schedule()
    assert len([ax for ax in fig.axes if ax.get_title()]) == 2 * (P - 1)
    fig.savefig(tmp_path / "s.png")
    ax = t.plot()
    assert [lab.get_text() for lab in ax.get_yticklabels()] == [f"rank {r}" for r in range(P)]
    ax.figure.savefig(tmp_path / "t.png")
    with pytest.raises(ValueError, match="no traced operation"):
        t.plot_schedule(op="broadcast")


def test_synthetic_records_and_chunk_labels():
    from xccl.teach.plots import chunk_label

    recs = [
        {"rank": 0, "kind": "send", "src": 0, "dst": 1, "step": 1, "offset": 32, "nbytes": 32,
         "start": 0.0, "end": 1e-5, "op": "all_reduce", "algo": "x", "seq": 3},
        {"rank": 1, "kind": "send", "src": 1, "dst": 0, "step": 1, "offset": 0, "nbytes": 16,
         "start": 0.0, "end": 2e-5, "op": "all_reduce", "algo": "x", "seq": 3},
    ]
    t = Trace.from_records(recs)
    assert t.ranks == [0, 1] and len(t) == 2
    assert chunk_unit(t.to_records()) == 16
    assert chunk_label(32, 32, 16) == ("c2-3", 2)
    assert chunk_label(0, 16, 16) == ("c0", 0)


def test_flight_recorder_parsing_and_table():
    text = (
        "comm 'default_pg' rank 1/3\n"
        "   seq  operation        algo           state          age_ms  waiting for\n"
        "     0  all_reduce       ring           done              3.0\n"
        "     1  broadcast        binomial       pending         812.5  recv<-0 send->2\n"
    )
    rows = parse_flight(text)
    assert [(r["seq"], r["op"], r["state"], r["waiting"]) for r in rows] == [
        (0, "all_reduce", "done", []), (1, "broadcast", "pending", ["recv<-0", "send->2"])]
    assert rows[0]["comm"] == "default_pg" and rows[0]["rank"] == 1
    table = waits_table(
        {1: text},
        errors={0: "all_reduce (algo ring, seq 4) on comm 'g' timed out after 1.0 s on rank 0: "
                   "waiting for a message from rank 2 (not started, 8 bytes), a send to rank 1 "
                   "(in transfer, 8 bytes)"},
        finished={2}, nranks=4)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["rank", "comm", "seq"]
    assert "timed out" in lines[1] and "recv<-2 send->1" in lines[1]
    assert "pending" in lines[2] and "recv<-0 send->2" in lines[2]
    assert "returned" in lines[3] and "unknown" in lines[4]


def _dump_all():
    import io

    x = np.zeros(4, np.float32)
    xccl.all_reduce(x)
    buf = io.StringIO()
    text = xccl.debug.dump(all_ranks=True, file=buf)
    return buf.getvalue(), text


def test_dump_all_ranks():
    import xccl.debug  # noqa: F401

    out = launch(_dump_all, 3)
    printed, _ = out[0]
    assert printed.splitlines()[0].split()[0] == "rank"
    assert printed.count("comm 'default_pg'") == 3 and "all_reduce" in printed
    assert out[1][0] == ""  # only rank 0 prints


def test_bindings_on_a_single_rank():
    comm = _C.Comm(_C.Store.hash(5.0), 0, 1, 5.0, None, None, "solo")
    comm.trace(16)
    x = np.ones(4, np.float32)
    comm.allreduce(x, x, _C.OPS["sum"]).wait()  # one rank: nothing to send or reduce
    assert comm.trace_drain() == [] and comm.trace_dropped() == 0
    dump = parse_flight(comm.flight_dump())
    assert [(r["comm"], r["op"], r["state"]) for r in dump] == [("solo", "all_reduce", "done")]
    with pytest.raises(ValueError, match="capacity"):
        comm.trace(-1)
    comm.trace(0)
    comm.destroy()
    for call in (lambda: comm.trace(4), comm.trace_drain, comm.flight_dump, comm.trace_dropped):
        with pytest.raises(_C.XcclError, match="destroyed"):
            call()
    with pytest.raises(ValueError, match="unknown collective"):
        _C.explain("all_sum", 8, 2)
    with pytest.raises(ValueError):
        _C.explain("all_reduce", -1, 2)
    with pytest.raises(ValueError):
        _C.explain("all_reduce", 8, 2, (1.0, 2.0))
    rows = _C.explain("broadcast", 1024, 4, (1e-6, 1e-9, 0.0))
    assert {r["name"] for r in rows} >= {"binomial", "linear"}
    assert all(set(r) == {"name", "summary", "steps", "bytes", "reduce_bytes", "copy_bytes",
                          "predicted_s", "applicable", "chosen", "source"} for r in rows)


# ------------------------------------------------------------------------------------ model


def test_explain_matches_the_formulas():
    a, b, g = 1e-5, 1e-9, 2e-10
    n = 1 << 20
    ex = explain("allreduce", n, size=P, model=(a, b, g))
    rows = {r["name"]: r for r in ex}
    assert set(rows) >= {"ring", "rd", "rabenseifner"}
    rd = rows["rd"]  # recursive doubling: log2(p) rounds of the whole vector
    assert rd["steps"] == math.log2(P) and rd["bytes"] == math.log2(P) * n
    ring = rows["ring"]  # 2(p-1)/p N bytes whatever the pipelining
    assert ring["bytes"] == pytest.approx(2 * (P - 1) / P * n)
    delta = 1.0 / 8e9  # the engine's memory-traffic default (explain.c), for copy_bytes
    for r in ex:
        if r["name"] in ("shm", "cma"):
            continue  # one-host algorithms add δ x copied bytes, which the rows do not list
        assert r["predicted_s"] == pytest.approx(
            a * r["steps"] + b * r["bytes"] + g * r["reduce_bytes"] + delta * r["copy_bytes"])
        assert r["latency_s"] + r["bandwidth_s"] + r["reduce_s"] + r["copy_s"] == pytest.approx(
            r["predicted_s"])
    assert sum(r["chosen"] for r in ex) == 1
    assert "<- chosen" in str(ex) and "<table>" in ex._repr_html_()
    assert _C.default_model() == Model.default().as_tuple()
    with pytest.raises(ValueError, match="unknown collective"):
        explain("all_sum", 8, size=2)
    with pytest.raises(ValueError, match="size="):
        explain("all_reduce", 8)


def _explain_vs_run(sizes):
    import numpy as np

    import xccl

    out = []
    for nbytes in sizes:
        for coll in ("all_reduce", "broadcast"):
            ex = xccl.explain(coll, nbytes)
            chosen = [r["name"] for r in ex if r["chosen"]]
            x = np.ones(nbytes // 4, np.float32)
            if coll == "all_reduce":
                w = xccl.all_reduce(x, async_op=True)
            else:
                w = xccl.broadcast(x, src=0, async_op=True)
            w.wait()
            out.append((nbytes, chosen, w.algo, ex.model.as_tuple()))
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_explain_in_a_group_predicts_what_runs(transport):
    # inside a group, explain prices with the group's own model (its transport's α, β), so
    # the algorithm it marks is the one the engine then runs
    rows = launch(_explain_vs_run, 4, [8, 4096, 1 << 16, 1 << 20, 32 << 20], transport=transport)
    for nbytes, chosen, ran, _ in rows[0]:
        assert chosen == [ran], (nbytes, chosen, ran)
    alphas = {model[0] for _, _, _, model in rows[0]}
    assert len(alphas) == 1


def test_group_models_differ_by_transport():
    def alpha():
        import xccl

        return xccl.explain("barrier", 0).model.alpha

    assert launch(alpha, 2, transport="shm")[0] < launch(alpha, 2, transport="tcp")[0]


def test_crossovers_and_predict():
    model = Model(2e-5, 5e-10, 2.5e-10)
    algos = ["rd", "rabenseifner"]
    cross = crossovers("all_reduce", P, model, algos)
    assert len(cross) == 1
    n, below, above = cross[0]
    assert (below, above) == ("rd", "rabenseifner")

    def best(size):
        rows = [r for r in predict("all_reduce", [size], P, model, algos)]
        return min(rows, key=lambda r: r["predicted_s"])["algo"]

    assert best(n - 1) == "rd" and best(n) == "rabenseifner"
    # rd sends N log2 p, rabenseifner 2N(p-1)/p in 2 log2 p rounds: equal when
    # alpha log2 p = beta N (log2 p - 2(p-1)/p) + gamma N (log2 p - (p-1)/p)
    lg = math.log2(P)
    exact = model.alpha * lg / (model.beta * (lg - 2 * (P - 1) / P) +
                                model.gamma * (lg - (P - 1) / P))
    assert abs(n - exact) <= 1


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 3e-5, 2e-9
    gamma = Model.default().gamma
    rows = []
    for algo in ("ring", "rd"):
        for n in (64, 4096, 1 << 16, 1 << 20):
            r = {x["name"]: x for x in explain("all_reduce", n, size=P)}[algo]
            t = alpha * r["steps"] + beta * r["bytes"] + gamma * r["reduce_bytes"]
            rows.append({"op": "all_reduce", "size": n, "algo": algo, "nranks": P,
                         "time": t, "transport": "shm", "algbw": 0.0, "busbw": 0.0,
                         "dtype": "float32", "count": n // 4, "iters": 1})
    m = fit_model(rows)
    assert m.alpha == pytest.approx(alpha, rel=1e-6) and m.beta == pytest.approx(beta, rel=1e-6)
    assert m.rel_error == pytest.approx(0.0, abs=1e-9) and m.source == "fit"
    res = BenchResult(rows)
    assert set(res.fit()) == {"shm"}
    # where the fitted model's cheapest algorithm changes, checked against its predictions
    # on either side
    predicted = res.crossovers()["predicted"]
    assert predicted, "ring and rd cross between 64 B and 1 MiB"
    for n, below, above in predicted:
        rows_at = res.predicted(sizes=[n - 1, n])
        best = {size: min((r for r in rows_at if r["size"] == size),
                          key=lambda r: r["predicted_s"])["algo"] for size in (n - 1, n)}
        assert (best[n - 1], best[n]) == (below, above), (n, best)
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = res.plot()
    assert "measured vs predicted" in ax.get_title()


def test_measured_crossovers():
    """The measured crossovers come from the times alone: where the fastest algorithm changes
    between two measured sizes, at their geometric mean (here rd, rd, ring, rd)."""
    times = {"rd": [1.0, 2.0, 9.0, 30.0], "ring": [3.0, 4.0, 5.0, 40.0]}
    sizes = [64, 4096, 1 << 16, 1 << 20]
    rows = [{"op": "all_reduce", "size": n, "algo": algo, "nranks": P, "time": t * 1e-6,
             "transport": "tcp", "algbw": 0.0, "busbw": 0.0, "dtype": "float32",
             "count": n // 4, "iters": 1}
            for algo, ts in times.items() for n, t in zip(sizes, ts, strict=True)]
    res = BenchResult(rows).crossovers(model=Model.default())
    assert res["measured"] == [(16384, "rd", "ring"), (262144, "ring", "rd")]
    one = BenchResult([r for r in rows if r["algo"] == "rd"]).crossovers(model=Model.default())
    assert one == {"predicted": [], "measured": []}


def test_bench_runs_and_reports_tidy_rows():
    res = bench("all_reduce", [64, 4096], ["ring", "rd"], nprocs=2, iters=3, repeats=1)
    assert [(r["algo"], r["size"]) for r in res] == [
        ("ring", 64), ("ring", 4096), ("rd", 64), ("rd", 4096)]
    for r in res:
        assert r["time"] > 0 and r["nranks"] == 2 and r["iters"] == 3
        assert r["algbw"] == pytest.approx(r["size"] / r["time"] / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)
        assert r["transport"] in ("shm", "tcp")
    m = res.fit()[res[0]["transport"]]
    assert m.alpha >= 0 and m.beta >= 0
    pp = bench("p2p", [8, 1024], nprocs=2, iters=3, repeats=1)
    assert [r["algo"] for r in pp] == ["p2p", "p2p"]

"""Tuning tables and xccl-tune: the fit, the table's ranges, loading ($XCCL_TUNE_FILE), the
selector's use of a table and where explain says a choice came from, malformed tables, tables
of other hosts, ranks that disagree, and one tiny real tuning run."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import xccl
from xccl import _group, tune

# the xccl this session imported (the in-place build under python/, or an installed one whose
# source tree next to the tests has no extension): child interpreters must import the same
PKG_PARENT = Path(xccl.__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_PARENT), env.get("PYTHONPATH", "")])
    env.pop("XCCL_TUNE_FILE", None)
    env.pop("XCCL_ALGO", None)
    return env


def _host_line(transport: str = "shm", cpu: str | None = None, cores: int | None = None) -> str:
    c, n = tune.host_signature()
    return f"host transport={transport} cores={cores or n} cpu={cpu or c}"


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    """init(table text) -> the process group of one rank with that table; destroyed after."""

    def init(text: str | None) -> xccl.ProcessGroup:
        if text is None:
            monkeypatch.delenv("XCCL_TUNE_FILE", raising=False)
        else:
            path = tmp_path / "table.txt"
            path.write_text(text)
            monkeypatch.setenv("XCCL_TUNE_FILE", str(path))
        xccl.init_process_group("shm", store=xccl.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        return _group.resolve(None)

    monkeypatch.delenv("XCCL_ALGO", raising=False)
    yield init
    xccl.destroy_process_group()


def _choice(pg: xccl.ProcessGroup, coll: str, nbytes: int) -> tuple[str, str]:
    rows = pg.comm.explain(coll, nbytes)
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1
    assert pg.comm.choose(coll, nbytes) == chosen[0]["name"]
    return chosen[0]["name"], chosen[0]["source"]


# ------------------------------------------------------------------------------- the fit


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(19)
    truth = [3.0e-6, 1.0 / 5e9, 1.0 / 9e9, 1.0 / 14e9]
    samples = []
    for _ in range(60):
        # cost terms shaped like the algorithms': a few steps, bytes over 6 decades
        n = float(2 ** rng.integers(3, 26))
        terms = [float(rng.integers(1, 12)), n * rng.uniform(0.2, 2), n * rng.uniform(0, 1),
                 n * rng.uniform(0, 1.5)]
        samples.append((terms, float(np.dot(terms, truth))))
    coef, known = tune.fit_model(samples, [1.0, 1.0, 1.0, 1.0])
    assert known == [True] * 4
    np.testing.assert_allclose(coef, truth, rtol=1e-6)
    # 2 % multiplicative noise: the fit stays close
    noisy = [(t, s * float(rng.uniform(0.98, 1.02))) for t, s in samples]
    coef, _ = tune.fit_model(noisy, [1.0] * 4)
    np.testing.assert_allclose(coef, truth, rtol=0.15)


def test_fit_keeps_defaults_for_unmeasured_terms_and_never_goes_negative():
    # no sample copies memory: delta keeps its default; gamma's true value is 0
    truth = [2e-6, 1e-10, 0.0]
    samples = [([s, b, 0.0, 0.0], 2e-6 * s + 1e-10 * b) for s, b in
               [(1, 8), (2, 1e3), (3, 1e5), (1, 1e6), (6, 1e7), (4, 64)]]
    samples += [([2, 1e6, 5e5, 0.0], 2e-6 * 2 + 1e-10 * 1e6 * 0.999)]  # gamma would be < 0
    coef, known = tune.fit_model(samples, [9.0, 9.0, 9.0, 7.0])
    assert known == [True, True, True, False]
    assert coef[3] == 7.0
    assert min(coef) >= 0.0
    np.testing.assert_allclose(coef[:2], truth[:2], rtol=0.02)


# ------------------------------------------------------------------------------- the table


def test_make_table_ranges_and_audit_lines():
    times = []
    for n, winner in [(8, "rd"), (1024, "rd"), (65536, "ring"), (1 << 20, "ring")]:
        for a in ("rd", "ring", "direct"):
            times.append(["all_reduce", 4, n, a, 1e-5 if a == winner else 2e-5])
    terms = [[c, p, n, a, 1.0, float(n), float(n), 0.0] for c, p, n, a, _ in times]
    text = tune.make_table(times, terms, "shm", [1e-5, 1e-9, 1e-9, 1e-9],
                           host=("Test CPU 3000", 64))
    lines = text.splitlines()
    assert lines[0] == "xccl-tune 1"
    assert "host transport=shm cores=64 cpu=Test CPU 3000" in lines
    choose = [ln for ln in lines if ln.startswith("choose ")]
    # boundary between 1024 and 65536: their geometric mean, 8192
    assert choose == ["choose all_reduce np=4 bytes=0-8192 algo=rd",
                      "choose all_reduce np=4 bytes=8193-1048576 algo=ring"]
    meas = [ln for ln in lines if ln.startswith("meas ")]
    assert len(meas) == 4 and meas[2].startswith("meas all_reduce np=4 bytes=65536 best=ring "
                                                 "ring=1e-05 ")


def test_table_round_trip_gives_the_same_choices(one_rank):
    # measured winners that the model would not choose (size 1: the model's choice differs
    # from these at least somewhere), written, loaded and chosen again
    times = []
    want = {("all_reduce", 8): "direct", ("all_reduce", 4096): "rd",
            ("all_reduce", 1 << 20): "owner", ("broadcast", 64): "chain",
            ("broadcast", 1 << 16): "scatter_allgather", ("barrier", 0): "linear"}
    for (c, n), w in want.items():
        for a in (r["name"] for r in xccl._C.explain(c, n, 1)):
            times.append([c, 1, n, a, 1e-6 if a == w else 5e-6])
    terms = [[c, p, n, a, 1.0, float(n), 0.0, 0.0] for c, p, n, a, _ in times]
    text = tune.make_table(times, terms, "shm", [1e-5, 1e-9, 1e-9, 1e-9])
    pg = one_rank(text)
    for (c, n), w in want.items():
        assert _choice(pg, c, n) == (w, "table"), (c, n)
    # between measured sizes the nearer one's winner (all_reduce 4096 covers 182..72408)
    assert _choice(pg, "all_reduce", 20000) == ("rd", "table")
    # above the largest measured size, and for collectives not measured: the fitted model
    assert _choice(pg, "all_reduce", 8 << 20)[1] == "model"
    assert _choice(pg, "all_gather", 64)[1] == "model"
    # the fitted model is the communicator's model
    fitted = [float(v.split("=")[1]) for v in
              next(ln for ln in text.splitlines() if ln.startswith("model ")).split()[1:]]
    np.testing.assert_allclose(pg.comm.cost_model()[:3], fitted[:3], rtol=1e-5)


def test_explain_names_the_source(one_rank):
    pg = one_rank(None)
    name, source = _choice(pg, "all_reduce", 1024)
    assert source == "model"
    ex = xccl.explain("all_reduce", 1024)
    assert ex.source == "model" and "<- chosen (model)" in str(ex)
    rows = xccl._C.explain("all_reduce", 1024, 4)
    assert [r["source"] for r in rows if r["chosen"]] == ["model"]
    assert all(r["source"] == "" for r in rows if not r["chosen"])


@pytest.mark.parametrize(
    "body, line, words",
    [
        ("", 0, "empty"),
        ("xccl-tune 2\n", 1, "version 2"),
        ("# a comment\nhost transport=shm cores=2 cpu=x\n", 2, "expected 'xccl-tune 1'"),
        ("xccl-tune 1\n{host}\nchoose all_reduce np=2 bytes=0-64 algo=nosuch\n", 3,
         "no algorithm 'nosuch'"),
        ("xccl-tune 1\n{host}\n\nchoose allreduce np=2 bytes=0-64 algo=rd\n", 4,
         "unknown collective"),
        ("xccl-tune 1\n{host}\nchoose all_reduce np=2 bytes=64-8 algo=rd\n", 3, "bad value"),
        ("xccl-tune 1\n{host}\nmodel alpha=1e-6 beta=1e-9 gamma=-1 delta=0\n", 3, "bad value"),
        ("xccl-tune 1\n{host}\nmodel alpha=1e-6 beta=1e-9\n", 3, "delta="),
        ("xccl-tune 1\nchoose all_reduce np=2 bytes=0-64 algo=rd\n", 2, "before the host"),
        ("xccl-tune 1\n{host}\nfrobnicate\n", 3, "unknown directive"),
        ("xccl-tune 1\n{host}\nmeas all_reduce np=2 bytes=8 rd=fast\n", 3, "bad value"),
        ("xccl-tune 1\nhost cores=2 cpu=x\n", 2, "transport="),
        ("xccl-tune 1\n", 0, "no host line"),
    ],
)
def test_malformed_table_names_the_line(one_rank, body, line, words):
    text = body.replace("{host}", _host_line())
    with pytest.raises(ValueError) as ei:  # XCCL_ERR_INVALID_ARG
        one_rank(text)
    msg = str(ei.value)
    assert "table.txt" in msg and words in msg, msg
    if line:
        assert f"table.txt:{line}:" in msg, msg


def test_missing_table_file_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XCCL_TUNE_FILE", str(tmp_path / "absent.txt"))
    with pytest.raises(ValueError, match="absent.txt: cannot open"):
        xccl.init_process_group("shm", store=xccl.HashStore(), rank=0, world_size=1)


_OTHER_HOST = """
import os, xccl
from xccl import _group
xccl.init_process_group("shm", store=xccl.HashStore(), rank=0, world_size=1)
pg = _group.resolve(None)
rows = pg.comm.explain("all_reduce", 8)
print("SOURCE", [r["source"] for r in rows if r["chosen"]][0], flush=True)
xccl.destroy_process_group()
"""


@pytest.mark.parametrize("other", ["cpu", "cores", "transport"])
def test_table_of_another_host_is_ignored_with_a_logged_reason(tmp_path, other):
    host = {"cpu": _host_line(cpu="Some Other CPU 9000"),
            "cores": _host_line(cores=4096), "transport": _host_line(transport="tcp")}[other]
    path = tmp_path / "t.txt"
    path.write_text(f"xccl-tune 1\n{host}\nchoose all_reduce np=1 bytes=0-64 algo=direct\n")
    env = _env() | {"XCCL_TUNE_FILE": str(path), "XCCL_DEBUG": "WARN"}
    p = subprocess.run([sys.executable, "-c", _OTHER_HOST], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "SOURCE model" in p.stdout
    assert "tuning table ignored" in p.stderr and str(path) in p.stderr, p.stderr
    want = {"cpu": "Some Other CPU 9000", "cores": "4096 cores", "transport": "transport tcp"}
    assert want[other] in p.stderr, p.stderr


def _init_with_table(files: list[str]) -> str:
    rank = int(os.environ["RANK"])
    os.environ["XCCL_TUNE_FILE"] = files[rank]
    store = os.environ["XCCL_TEST_STORE"]
    try:
        xccl.init_process_group("shm", init_method=f"file://{store}", rank=rank,
                                world_size=len(files), timeout=timedelta(seconds=30))
    except (ValueError, xccl.XcclError) as e:
        return str(e)
    xccl.destroy_process_group()
    return "ok"


def test_ranks_with_different_tables_fail_init_on_every_rank(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(f"xccl-tune 1\n{_host_line()}\nchoose all_reduce np=2 bytes=0-64 algo=rd\n")
    b.write_text(f"xccl-tune 1\n{_host_line()}\nchoose all_reduce np=2 bytes=0-64 algo=ring\n")
    env = {"XCCL_TEST_STORE": str(tmp_path / "store1")}
    out = xccl.launch(_init_with_table, 2, [str(a), str(b)], init=False, env=env, timeout=60)
    for msg in out:
        assert "tuning tables differ" in msg, out
        assert f"rank 0: XCCL_TUNE_FILE={a}" in msg and f"rank 1: XCCL_TUNE_FILE={b}" in msg
    # one rank without a table
    env = {"XCCL_TEST_STORE": str(tmp_path / "store2")}
    out = xccl.launch(_init_with_table, 2, [str(a), ""], init=False, env=env, timeout=60)
    assert all("rank 1: no table" in m for m in out), out
    # a malformed table on rank 1: rank 1 names its line, rank 0 names rank 1's file
    bad = tmp_path / "bad.txt"
    bad.write_text("xccl-tune 1\nbogus\n")
    env = {"XCCL_TEST_STORE": str(tmp_path / "store3")}
    out = xccl.launch(_init_with_table, 2, [str(a), str(bad)], init=False, env=env, timeout=60)
    assert "rank 1 could not load its tuning table" in out[0] and str(bad) in out[0], out
    assert f"{bad}:2: unknown directive" in out[1], out
    # the same content in two files agrees
    c = tmp_path / "c.txt"
    c.write_bytes(a.read_bytes())
    env = {"XCCL_TEST_STORE": str(tmp_path / "store4")}
    assert xccl.launch(_init_with_table, 2, [str(a), str(c)], init=False, env=env,
                       timeout=60) == ["ok", "ok"]


# ------------------------------------------------------------------------------- a real run


def _choices(keys: list[tuple[str, int]]) -> list[tuple[str, str]]:
    pg = _group.resolve(None)
    out = [_choice(pg, c, n) for c, n in keys]
    # what a call runs is what explain said
    x = np.full(8, xccl.get_rank() + 1, np.uint8)
    w = xccl.all_reduce(x, async_op=True)
    w.wait()
    np.testing.assert_array_equal(x, np.full(8, 3, np.uint8))
    assert w.algo == _choice(pg, "all_reduce", 8)[0], w.algo
    return out


def test_tiny_real_tuning_run(tmp_path):
    out = tmp_path / "tuned.txt"
    p = subprocess.run([sys.executable, "-m", "xccl.tune", "--np", "2", "--colls",
                        "all_reduce,broadcast", "--sizes", "8,1m", "--budget", "2", "--out",
                        str(out)], env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "100%" in p.stderr and f"wrote {out}" in p.stderr
    text = out.read_text()
    winners = {}
    for ln in text.splitlines():
        if ln.startswith("meas "):
            f = ln.split()
            kv = dict(x.split("=", 1) for x in f[2:])
            times = {k: float(v) for k, v in kv.items() if k not in ("np", "bytes", "best")}
            assert kv["best"] == min(times, key=times.__getitem__)  # the winner is the fastest
            winners[(f[1], int(kv["bytes"]))] = kv["best"]
    assert set(winners) == {("all_reduce", 8), ("all_reduce", 1 << 20), ("broadcast", 8),
                            ("broadcast", 1 << 20)}
    measured = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("meas ")}
    # every algorithm was measured, the one-host ones too where the ranks share a segment
    assert all(f" {a}=" in measured["all_reduce"] for a in ("ring", "rd", "owner"))
    keys = sorted(winners) + [("all_reduce", 64 << 20)]
    before = xccl.launch(_choices, 2, keys, transport="shm", env={"XCCL_TUNE_FILE": ""},
                         timeout=120)[0]
    after = xccl.launch(_choices, 2, keys, transport="shm", env={"XCCL_TUNE_FILE": str(out)},
                        timeout=120)[0]
    # every measured point now runs its measured winner, from the table
    assert after[:-1] == [(winners[k], "table") for k in sorted(winners)]
    assert all(s != "table" for _, s in before)
    # beyond the table, the fitted model replaces the built-in rules (owner from 16 MiB on 2
    # ranks, or the one-host block where the ranks share a segment)
    assert before[-1][1] == "rule" and after[-1][1] == "model"


def test_cli_rejects_bad_arguments(capsys):
    assert tune.main(["--np", "1", "--out", "x"]) == 2
    assert "rank count >= 2" in capsys.readouterr().err
    assert tune.main(["--np", "2", "--out", "x", "--colls", "allreduce,nope"]) == 2
    assert "unknown collective 'nope'" in capsys.readouterr().err
    assert tune.main(["--np", "2", "--out", "x", "--sizes", "8,lots"]) == 2
    assert "bad size 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--np", "2", "--out", "x", "--transport", "ib"])

#!/usr/bin/env python3
"""Soak test: many threads per rank issuing random collectives and point-to-point operations
on overlapping subgroups for a fixed time, every result checked against numpy.

    PYTHONPATH=python python tests/soak.py --minutes 1       # CI: 4 ranks x 4 threads
    PYTHONPATH=python python tests/soak.py --minutes 60 --np 6 --threads 8 --seed 3

The ranks import the xccl their environment finds (an installed one, or python/ of a built
tree on PYTHONPATH, as above).

The job has ``--np`` ranks (one process each, meeting through a file store in a private
directory) spread over ``--hosts`` hosts (``XCCL_HOST_ID``: shared memory inside a host, TCP
between hosts). In every rank, ``--threads`` threads each own ``--groups`` process groups of
their own (created by the main thread, in the same order on every rank, before the threads
start): thread t's groups are random sets of ranks, so groups of different threads overlap in
membership, and each group is only ever used by the thread that owns it, so every group sees
the same order of operations on every rank. Each thread runs the shared random workload
(tests/workload.py) with its own seed over its groups, in chunks of ``CHUNK`` operations;
after each chunk the thread's ranks agree (an all_reduce on the thread's own all-ranks group)
whether time is up, so that they all stop after the same operation.

Every rank logs, every ``--log-every`` seconds, its operations per second, bytes per second and
resident set size (RSS). The median RSS of the last fifth of the run may exceed that of the
second fifth (after a warm-up of one fifth) by at most ``--rss-growth-mib`` MiB (default 32);
more is a failure (a leak). The ranks
run with glibc's arena count and mmap threshold fixed (MALLOC_ENV, unless the environment sets
them), so that allocator caching does not pass for a leak.

Exits 0 when every rank finished with every result right and RSS within the bound; 1 on any
wrong result, error, hang (the whole run is bounded by minutes + 2 minutes: stacks are
dumped, everything is killed) or RSS growth. The last line is a JSON summary:
``SOAK {"ops": ..., "bytes": ..., "seconds": ..., "ok": true, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Optional

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)

import workload as W  # noqa: E402

CHUNK = 25  # operations between two stop votes
# glibc's allocator, left alone, gives each thread an arena and raises its mmap threshold as
# large buffers are freed: RSS then drifts up by tens of MiB over minutes with no leak (seen:
# +60 MiB in 2 min with 8 threads; flat with these). Fixed, RSS tracks what is allocated.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}
HARD_EXTRA_S = 120.0  # beyond --minutes, before the run is declared hung


def rss_mib() -> float:
    """This process's resident set size in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def rss_windows(samples: list[tuple[float, float]], seconds: float
                ) -> tuple[float, float, float]:
    """(early, late, growth): the median RSS of the samples in the second fifth of the run
    (after the warm-up) and in the last fifth, and late - early. Medians over windows, not
    single samples: a transient peak (a burst of large buffers) is not a leak, a steady
    climb is."""
    def median(lo: float, hi: float) -> float:
        v = sorted(r for t, r in samples if lo <= t <= hi)
        return v[len(v) // 2] if v else 0.0

    early = median(seconds * 0.2, seconds * 0.4)
    late = median(seconds * 0.8, seconds)
    return early, late, (late - early) if early and late else 0.0


# --------------------------------------------------------------------------- one rank


class ThreadStats:
    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.error: Optional[str] = None


def _thread_main(xccl: Any, args: argparse.Namespace, rank: int, t: int, groups: list[list[int]],
                 handles: list[Any], control: Any, deadline: float, st: ThreadStats) -> None:
    import numpy as np

    seed = args.seed * 7919 + t
    wl = W.Workload(seed, args.np, groups, max_count=args.max_count)
    try:
        while True:
            for op in wl.ops(CHUNK):
                if args.selftest == "wrong" and rank == 0 and t == 0 and st.ops >= 10:
                    raise W.WrongResult(f"self-test: op #{op.index} pretends to be wrong")
                members = groups[op.group]
                st.bytes += W.run_op(xccl, seed, op, handles[op.group], rank, members)
                st.ops += rank in op.participants(members)  # ops this rank ran and checked
            vote = np.array([1 if time.monotonic() >= deadline else 0], np.int32)
            xccl.all_reduce(vote, op=xccl.ReduceOp.MAX, group=control)
            if vote[0]:
                return
    except BaseException as e:  # noqa: BLE001 - reported by the rank
        st.error = f"thread {t}: {type(e).__name__}: {e}"


def rank_main(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    import xccl

    rank = args.rank
    xccl.init_process_group("auto", init_method=args.init, rank=rank, world_size=args.np,
                            timeout=timedelta(seconds=args.timeout))
    rng = random.Random(f"soak/{args.seed}")  # the same on every rank
    per_thread = []
    for _ in range(args.threads):
        groups = W.random_groups(rng, args.np, args.groups)
        handles = [xccl.new_group(list(range(args.np)))]  # the thread's own "world"
        handles += [xccl.new_group(g) for g in groups[1:]]
        control = xccl.new_group(list(range(args.np)))
        per_thread.append((groups, handles, control))
    xccl.barrier()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60.0
    stats = [ThreadStats() for _ in range(args.threads)]
    threads = [
        threading.Thread(target=_thread_main, name=f"soak-{t}", daemon=True,
                         args=(xccl, args, rank, t, *per_thread[t], deadline, stats[t]))
        for t in range(args.threads)
    ]
    for th in threads:
        th.start()
    samples: list[tuple[float, float]] = []  # (seconds since start, RSS MiB)
    last_t, last_ops, last_bytes = t0, 0, 0
    while any(th.is_alive() for th in threads):
        time.sleep(min(args.log_every, 0.5))
        now = time.monotonic()
        rss = rss_mib()
        samples.append((now - t0, rss))
        if now - last_t >= args.log_every:
            ops = sum(s.ops for s in stats)
            nbytes = sum(s.bytes for s in stats)
            dt = now - last_t
            print(f"rank {rank} t={now - t0:6.1f}s ops/s={(ops - last_ops) / dt:8.1f} "
                  f"MB/s={(nbytes - last_bytes) / dt / 1e6:8.2f} rss={rss:7.1f}MiB "
                  f"ops={ops}", flush=True)
            last_t, last_ops, last_bytes = now, ops, nbytes
        if any(s.error for s in stats):
            break
    errors = [s.error for s in stats if s.error]
    seconds = time.monotonic() - t0
    early, late, growth = rss_windows(samples, seconds)
    result = {
        "rank": rank,
        "ops": sum(s.ops for s in stats),
        "bytes": sum(s.bytes for s in stats),
        "seconds": seconds,
        "rss_early_mib": early,
        "rss_late_mib": late,
        "rss_growth_mib": growth,
        "errors": errors,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if errors:
        os._exit(1)  # other threads may be stuck in an operation: do not wait for them
    xccl.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the job


def job_main(args: argparse.Namespace) -> int:
    tmp = tempfile.mkdtemp(prefix="xccl-soak-")
    init = f"file://{tmp}/store"
    procs = []
    env = dict(os.environ)
    print(f"soak: {args.np} ranks on {args.hosts} host(s) x {args.threads} threads x "
          f"{args.groups} groups, {args.minutes:g} min, seed {args.seed}", flush=True)
    try:
        for r in range(args.np):
            e = dict(env, XCCL_HOST_ID=f"soak-host-{r % args.hosts}")
            for k, v in MALLOC_ENV.items():
                e.setdefault(k, v)
            cmd = [
                sys.executable, os.path.abspath(__file__), "--rank", str(r), "--init", init,
                "--minutes", str(args.minutes), "--np", str(args.np), "--threads",
                str(args.threads), "--groups", str(args.groups), "--seed", str(args.seed),
                "--timeout", str(args.timeout), "--log-every", str(args.log_every),
                "--max-count", str(args.max_count), "--selftest", args.selftest]
            procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        results: dict[int, dict] = {}

        def pump(r: int, p: subprocess.Popen) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("RESULT "):
                    results[r] = json.loads(line[7:])
                print(f"[rank {r}] {line}", end="", flush=True)

        readers = [threading.Thread(target=pump, args=(r, p), daemon=True)
                   for r, p in enumerate(procs)]
        for th in readers:
            th.start()
        hard = time.monotonic() + args.minutes * 60.0 + HARD_EXTRA_S
        hung = False
        failed_at: Optional[float] = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # the others will fail with xccl errors or hang: bound it
            if now >= hard or (failed_at is not None and now - failed_at > args.timeout + 10):
                hung = now >= hard
                for p in procs:
                    if p.poll() is None:
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                break
            time.sleep(0.2)
        for p in procs:
            p.wait()
        for th in readers:
            th.join(5.0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    problems = []
    if hung:
        problems.append("HANG: the run did not end within --minutes + "
                        f"{HARD_EXTRA_S:g} s (stacks dumped above)")
    for r, p in enumerate(procs):
        res = results.get(r)
        if p.returncode != 0:
            problems.append(f"rank {r} exited with {p.returncode}")
        if res is None:
            problems.append(f"rank {r} reported no result")
            continue
        problems += [f"rank {r}: {e}" for e in res["errors"]]
        if res["rss_growth_mib"] > args.rss_growth_mib:
            problems.append(f"rank {r}: RSS grew {res['rss_growth_mib']:.1f} MiB after the "
                            f"warm-up (bound {args.rss_growth_mib:g} MiB)")
    ops = sum(r["ops"] for r in results.values())
    nbytes = sum(r["bytes"] for r in results.values())
    secs = max((r["seconds"] for r in results.values()), default=0.0)
    summary = {
        "ok": not problems,
        "ops": ops,
        "bytes": nbytes,
        "seconds": round(secs, 1),
        "ops_per_s": round(ops / secs, 1) if secs else 0.0,
        "mb_per_s": round(nbytes / secs / 1e6, 2) if secs else 0.0,
        "max_rss_growth_mib": round(max((r["rss_growth_mib"] for r in results.values()),
                                        default=0.0), 1),
        "np": args.np, "threads": args.threads, "seed": args.seed,
        "problems": problems,
    }
    for prob in problems:
        print("soak FAILED: " + prob, flush=True)
    if problems:
        print(f"replay: cd {REPO} && python tests/soak.py --minutes {args.minutes:g} "
              f"--np {args.np} --threads {args.threads} --groups {args.groups} "
              f"--hosts {args.hosts} --seed {args.seed}", flush=True)
    print("SOAK " + json.dumps(summary), flush=True)
    return 0 if not problems else 1


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--threads", type=int, default=4, help="threads per rank (default 4)")
    ap.add_argument("--groups", type=int, default=3, help="groups per thread (default 3)")
    ap.add_argument("--hosts", type=int, default=2, help="XCCL_HOST_IDs (default 2)")
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--timeout", type=float, default=60.0, help="xccl timeout (s)")
    ap.add_argument("--log-every", type=float, default=10.0, help="seconds between logs")
    ap.add_argument("--max-count", type=int, default=4096, help="largest element count")
    ap.add_argument("--rss-growth-mib", type=float, default=32.0,
                    help="largest RSS growth after the warm-up (MiB, default 32)")
    ap.add_argument("--selftest", choices=["", "wrong"], default="",
                    help="wrong: rank 0 reports a wrong result, to see the soak fail")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.np < 2 or args.threads < 1 or args.groups < 1 or args.hosts < 1:
        ap.error("--np must be >= 2; --threads, --groups and --hosts >= 1")
    if args.minutes <= 0:
        ap.error("--minutes must be positive")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if args.rank is not None:
        return rank_main(args)
    return job_main(args)


if __name__ == "__main__":
    sys.exit(main())

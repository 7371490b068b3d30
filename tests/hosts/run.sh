#!/usr/bin/env bash
# tests/hosts/run.sh: run a Python script as one xccl job over H "hosts" on this machine.
#
#   tests/hosts/run.sh --hosts H --ranks-per-host R[,R1,...] [--rate 1gbit] [--timeout S]
#                      [--grace S] [--link-down HOST:SECONDS] [--kill-host HOST:SECONDS]
#                      [--mismatched-keys] [--decoy]
#                      [--port P] -- SCRIPT [ARGS...]
#   tests/hosts/run.sh --cleanup        # remove what a harness killed with SIGKILL left (namespaces)
#
# Every host is a network namespace (veth0 at 10.99.0.<i+1>, bridged to the others through a
# bridge in a namespace of its own; optional tc tbf shaping) whose processes also get their
# own IPC, UTS (hostname host<i>), mount (private /dev/shm) and PID namespaces. Each host runs
# `python -m xccl.run --nnodes H --nproc-per-node R --node-rank i ...` with one shared random
# XCCL_AUTH_KEY. The exit status is the job's (124: --timeout). Namespaces, links and
# processes are removed on every exit path. Needs root, ip(8), tc(8) and unshare(1).
# The work is done by hostnet.py beside this file (its docstring has the details);
# $PYTHON picks the interpreter (default python3), PYTHONPATH passes through to the ranks.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}

if [ "$(id -u)" -ne 0 ]; then
    echo "run.sh: error: needs root (it creates network namespaces)" >&2
    exit 2
fi
for tool in ip tc unshare "$py"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "run.sh: error: '$tool' not found" >&2
        exit 2
    fi
done

exec "$py" "$here/hostnet.py" "$@"

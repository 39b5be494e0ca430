"""How the coordination of a save and a load scales with ranks: the product's real `Group` (store
steps, heartbeats, failure propagation, the final acknowledgement) for N simulated ranks against a
real TCPStore, without tensors.

Each simulated rank is a thread holding its own store connection (`_core.StoreClient`, which
releases the GIL) and its own native heartbeat (`_core.Heartbeat`), as a process of a job would;
ranks are spread over `--procs` processes. `--rtt-ms X` adds X ms to every store round trip, a
cluster's network. Per operation the ranks run what `save` and `load` run on the store:

  save: plan (every rank describes its state, rank 0 plans and scatters assignments), lease, commit,
        close (the acknowledged last step)
  load: open (arguments compared, rank 0 reads the manifest), check and decide how to read (each
        rank's needs in, each rank's plan out), the last step (every rank has read all it needs),
        close

(payloads are not modelled: a manifest, needs or plans beyond the store step's 1 MiB budget move
by collectives, a smaller manifest in the open step's outcome).
A step's time is the time from the moment the last rank finished the previous step to the
moment the last rank finished this one. Then one rank fails inside a step and the harness times
how long until every rank has raised. On this machine every rank's Python shares a few cores; what
stays serial on a cluster, where each rank has a core, is printed too: the CPU time per step of the
store's server (a thread of this process) and of rank 0, the root (unpickling every rank's message,
deciding, pickling the outcome).

    python benches/coord_scale.py --ranks 4096 [--rtt-ms 0.2] [--ops 6] [--protocol before]

`--protocol before` runs the coordination code of eedafe9 (read from git) on the same harness.
Last line: `coordination: N ranks, X ms per step (median), Y store requests per rank per step`.
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import itertools
import math
import multiprocessing as mp
import os
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

BEFORE = "eedafe9"


def _before_module() -> Any:
    """The coordination module of commit BEFORE, loaded from git as olmo_chunks._dist_before."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{BEFORE}:python/olmo_chunks/_dist.py"], check=True,
                         capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("olmo_chunks._dist_before", loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "olmo_chunks"
    exec(compile(src, "_dist_before.py", "exec"), mod.__dict__)
    return mod


class _Before:
    """Builds groups of the old protocol over torch store clients (its only kind)."""

    def __init__(self, host: str, port: int) -> None:
        import torch.distributed as dist

        self.mod = _before_module()
        self.host, self.port, self.dist = host, port, dist

    def client(self, timeout: float, rtt: float) -> Any:
        return self.dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(timeout, 60)))

    def group(self, rank: int, size: int, store: Any, prefix: str, peer_timeout: float) -> Any:
        g = self.mod.Group.__new__(self.mod.Group)
        g.pg, g.active, g.rank, g.size, g.peer_timeout, g.seq = None, False, rank, size, peer_timeout, 0
        g.store, g.prefix, g.global_ranks = store, prefix, list(range(size))
        g.close = lambda failing=False: None
        return g


class _Now:
    """Builds groups of the current protocol over the core's store clients."""

    def __init__(self, host: str, port: int) -> None:
        from olmo_chunks import _core, _dist

        self.core, self.mod, self.host, self.port = _core, _dist, host, port

    def client(self, timeout: float, rtt: float) -> Any:
        # Generous: the connections of thousands of ranks at once queue at the server.
        return self.core.StoreClient(self.host, self.port, max(timeout, 600), rtt)

    def group(self, rank: int, size: int, store: Any, prefix: str, peer_timeout: float) -> Any:
        return self.mod.Group.simulated(rank, size, store, prefix, peer_timeout=peer_timeout, arrival_timeout=600)


def _describe(rank: int) -> tuple[dict, dict, bool, dict]:
    """A rank's message of a save's plan step: a few tensors' regions (about 300 bytes; plain
    data, which the coordination of `--protocol before` also accepts)."""
    tensors = {f"layers.{i}.w": ("float32", [4096, 4096], "main", [([rank * 16, 0], [16, 4096])])
               for i in range(3)}
    return tensors, {}, False, {"path": "/ckpt", "overwrite": True, "block_size": 1 << 20, "compression": None}


def _rank(proto: Any, rank: int, size: int, args: argparse.Namespace, go: threading.Event,
          out: dict[int, Any]) -> None:
    from olmo_chunks import _core
    from olmo_chunks.errors import RankFailedError

    store = proto.client(args.peer_timeout, args.rtt_ms / 1000)
    every = min(2.0, args.peer_timeout / 4)
    hb = _core.Heartbeat(proto.host, proto.port, f"olmo_chunks/hb/{rank}", every, args.peer_timeout)
    store.set(f"olmo_chunks/hb/{rank}/every", str(every).encode())  # as a process's link says its interval
    store.append("olmo_chunks/started", struct.pack("<I", rank))
    go.wait()
    times: list[float] = []
    requests0 = getattr(store, "requests", 0)
    cpu0 = time.thread_time()
    for op in range(args.ops):
        g = proto.group(rank, size, store, f"olmo_chunks/sim/{op}", args.peer_timeout)
        if op % 2 == 0:  # a save
            g.exchange(lambda: _describe(rank), lambda gathered: [("save-1", [0, 1, 2])] * size, scatter=True)
            times.append(time.time())
            g.exchange(None, lambda _: "save-1")
            times.append(time.time())
            g.exchange(lambda: [], lambda written: None)
            times.append(time.time())
        else:  # a load
            g.exchange(lambda: {"path": "/ckpt", "read": "auto"}, lambda gathered: ("ok", 123456, ""))
            times.append(time.time())
            # What to load agreed and how to read it decided in one step (`FillStep`): each rank
            # sends whether it is on CUDA, the exchanges it has measured and its needs (inline,
            # at most max(256, 1 MiB / N) bytes; 200 bytes here); rank 0 sends each its decision
            # and plan.
            needs = bytes(200)
            g.exchange(lambda needs=needs: (False, ["cpu"], needs),
                       lambda got, needs=needs: [(("once", 0.1, 0.09, ""), "cpu", False, needs)] * size,
                       scatter=True)
            times.append(time.time())
            g.agree(lambda: None)  # the last step: no rank returns before every rank has read
            times.append(time.time())
        g.close()
        times.append(time.time())
    requests = getattr(store, "requests", 0) - requests0
    cpu = time.thread_time() - cpu0  # rank 0's: the root's serial share of every step
    waiting = _straggle(proto, rank, size, store, args) if args.straggle > 0 else 0
    # One failure: the last rank fails inside a step; every rank must raise.
    g = proto.group(rank, size, store, "olmo_chunks/sim/fail", args.peer_timeout)
    t_fail = 0.0

    def local() -> None:
        nonlocal t_fail
        if rank == size - 1:
            t_fail = time.time()
            raise ValueError("simulated failure")

    raised_at = 0.0
    try:
        g.exchange(local, lambda _: None)
    except (RankFailedError, ValueError):
        raised_at = time.time()
    g.close(failing=True)
    hb.stop()
    out[rank] = (times, requests, raised_at, t_fail, waiting, cpu)


def _straggle(proto: Any, rank: int, size: int, store: Any, args: argparse.Namespace) -> int:
    """A straggler: the last rank comes to a step `--straggle` seconds late; what the others ask of
    the store meanwhile (their looks at liveness and abort notes) is what waiting costs. Returns
    this rank's requests in that step."""
    g = proto.group(rank, size, store, "olmo_chunks/sim/straggle", args.peer_timeout)
    before = getattr(store, "requests", 0)
    if rank == size - 1:
        time.sleep(args.straggle)
    g.agree(lambda: None)
    waiting: int = getattr(store, "requests", 0) - before
    g.close()
    return waiting


def _worker(ranks: list[int], size: int, args: argparse.Namespace, host: str, port: int, q: Any) -> None:
    threading.stack_size(512 << 10)
    proto = _Before(host, port) if args.protocol == "before" else _Now(host, port)
    go = threading.Event()
    out: dict[int, Any] = {}
    def rank_main(r: int) -> None:
        try:
            _rank(proto, r, size, args, go, out)
        except BaseException as exc:  # reported by the parent, which then stops
            out[r] = f"{type(exc).__name__}: {exc}"
            go.set()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    from olmo_chunks import _core

    ctl = _core.StoreClient(host, port, 600)
    time.sleep(0.5)
    ctl.add("sim/ready", 1)
    ctl.wait(["sim/go"], 600)
    go.set()
    for t in threads:
        t.join()
    q.put(out)


class _CpuClock:
    """This process's CPU time, sampled every 10 ms until `done` is set: the store server's (its
    thread serves every rank; the main thread only waits)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.done.wait(0.01):
            self.samples.append((time.time(), time.process_time()))

    def at(self, t: float) -> float:
        """CPU seconds at wall-clock time `t`, between the samples around it."""
        i = bisect.bisect(self.samples, (t, math.inf))
        (w0, c0), (w1, c1) = self.samples[max(i - 1, 0)], self.samples[min(i, len(self.samples) - 1)]
        return c0 if w1 <= w0 else c0 + (c1 - c0) * (t - w0) / (w1 - w0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    ap.add_argument("--procs", type=int, default=None,
                    help="processes holding the simulated ranks (default: one per 256 ranks, at least 2; "
                    "thousands of threads in one interpreter queue on its lock, not on the store)")
    ap.add_argument("--ops", type=int, default=6, help="operations, saves and loads alternating")
    ap.add_argument("--peer-timeout", type=float, default=45.0)
    ap.add_argument("--protocol", choices=("now", "before"), default="now")
    ap.add_argument("--straggle", type=float, default=0.0,
                    help="then one more step that the last rank comes to this many seconds late")
    args = ap.parse_args()
    args.procs = args.procs or max(2, -(-args.ranks // 256))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import torch.distributed as dist
    from olmo_chunks import _core

    # The server listens on an IPv4 socket of its own: on the dual-stack socket torch would open,
    # every client is `::ffff:127.0.0.1`, which /etc/hosts does not name, and the server's event
    # loop resolves each new connection's peer through DNS (this sandbox's DNS server drops about
    # one query in 50: a 5 s stall of every rank, each time).
    listener = socket.socket(socket.AF_INET)
    listener.bind(("127.0.0.1", 0))
    listener.listen(socket.SOMAXCONN)
    host, port = listener.getsockname()
    _server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,  # alive until the end
                            master_listen_fd=listener.fileno())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(list(range(i, args.ranks, args.procs)), args.ranks, args, host, port, q))
             for i in range(args.procs)]
    for p in procs:
        p.start()
    ctl = _core.StoreClient(host, port, 600)
    while ctl.add("sim/ready", 0) < args.procs:
        time.sleep(0.1)
    server = _CpuClock()
    ctl.set("sim/go", b"")
    results: dict[int, Any] = {}
    for _ in procs:
        results.update(q.get(timeout=1200))
    server.done.set()
    for p in procs:
        p.join()
    _report(args, results, server)


def _report(args: argparse.Namespace, results: dict[int, Any], server: _CpuClock) -> None:
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed:
        r, why = min(failed.items())
        sys.exit(f"{len(failed)} of {args.ranks} simulated ranks failed (rank {r}: {why})")
    steps = len(results[0][0])
    ends = [max(results[r][0][k] for r in results) for k in range(steps)]
    durations = [(b - a) * 1000 for a, b in itertools.pairwise(ends)]
    median = statistics.median(durations)
    per_step = sum(results[r][1] for r in results) / len(results) / steps
    t_fail = max(results[r][3] for r in results)
    spread = (max(results[r][2] for r in results) - t_fail) * 1000
    print(f"protocol {args.protocol}, {args.ranks} ranks over {args.procs} processes, rtt {args.rtt_ms:g} ms: "
          f"{steps} steps, per step ms min {min(durations):.1f} median {median:.1f} max {max(durations):.1f}")
    print(f"a failure on rank {args.ranks - 1} reached all {args.ranks} ranks in {spread:.0f} ms")
    server_ms = (server.at(ends[-1]) - server.at(ends[0])) * 1000 / len(durations)
    print(f"CPU per step: the store's server {server_ms:.1f} ms, rank 0 (the root) {results[0][5] * 1000 / steps:.1f} "
          "ms; both are serial, a step's floor where every rank has a core of its own")
    reqs = f"{per_step:.1f}" if args.protocol == "now" else "n/a (torch client, not counted)"
    if args.straggle > 0 and args.protocol == "now":
        rate = sum(results[r][4] for r in results if r != args.ranks - 1) / args.straggle
        print(f"while rank {args.ranks - 1} came {args.straggle:g} s late, the other {args.ranks - 1} ranks sent the "
              f"store {rate:.0f} requests per second ({rate / (args.ranks - 1):.2f} per rank, the step's own 4 "
              "each included)")
    print(f"coordination: {args.ranks} ranks, {median:.1f} ms per step (median), {reqs} store requests per rank "
          "per step")


if __name__ == "__main__":
    sys.exit(main())

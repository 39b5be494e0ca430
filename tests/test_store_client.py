"""The core's TCPStore client and heartbeat against torch's own TCPStore server, and against a
server that accepts connections and never answers (a stopped rank 0)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from olmo_chunks import _core


@pytest.fixture(scope="module")
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_calls_speak_torchs_protocol(server):
    c = _core.StoreClient("127.0.0.1", server.port, 5.0)
    c.set("a", b"\x00\x01")
    assert server.get("a") == b"\x00\x01"
    server.set("b", b"from torch")
    assert c.get("b") == b"from torch"
    assert c.add("n", 3) == 3 and server.add("n", 0) == 3
    c.append("a", b"++")
    assert c.get("a") == b"\x00\x01++"
    assert c.check(["a", "b"]) and not c.check(["a", "missing"])
    assert c.multi_get(["a", "n"]) == [b"\x00\x01++", b"3"]
    c.set_many(["p", "q"], [b"P", b"Q"])
    assert server.multi_get(["p", "q"]) == [b"P", b"Q"]
    assert c.delete(["p", "q", "never"]) == 2 and not server.check(["p"])
    assert c.requests == 13  # set_many and delete count each key's query


def test_a_timed_wait_is_cancelled_and_the_connection_stays_usable(server):
    c = _core.StoreClient("127.0.0.1", server.port, 5.0)
    t0 = time.monotonic()
    assert c.wait(["w1"], 0.2) is False
    assert 0.15 < time.monotonic() - t0 < 2
    server.set("w1", b"")
    assert c.wait(["w1"], 0.2) is True
    assert c.add("after-wait", 1) == 1


def test_a_timed_wait_prints_nothing(server):
    """torch's client logs two warnings per timed-out wait; ours none (waiting ranks poll)."""
    code = (f"from olmo_chunks import _core; c = _core.StoreClient('127.0.0.1', {server.port}, 5.0); "
            "print([c.wait(['never'], 0.05) for _ in range(3)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[False, False, False]" and "timed out" not in out.stderr, out


def test_the_heartbeat_beats_from_a_native_thread(server):
    hb = _core.Heartbeat("127.0.0.1", server.port, "hb/test", 0.05, 10.0)
    time.sleep(0.5)
    hb.stop()
    beats = hb.beats
    assert beats >= 4 and int(server.get("hb/test")) == beats


def test_the_heartbeat_sleeps_until_its_next_beat_yet_stops_and_speeds_up_at_once(server):
    """Between beats the thread waits on a condition variable (no polling): a shorter interval
    takes effect at once, and stop() returns at once, whatever the interval."""
    hb = _core.Heartbeat("127.0.0.1", server.port, "hb/slow", 3600.0, 10.0)
    time.sleep(0.2)
    assert hb.beats == 1  # the first beat, sent by the constructor; the next is an hour away
    hb.set_interval(0.02)
    deadline = time.monotonic() + 5
    while hb.beats < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hb.beats >= 3
    hb.set_interval(3600.0)
    t0 = time.monotonic()
    hb.stop()
    assert time.monotonic() - t0 < 1
    assert int(server.get("hb/slow")) == hb.beats


def test_a_process_whose_store_host_died_exits_at_once():
    """The heartbeat reconnects to a store whose host died for its whole timeout; the process's
    exit (which stops it) no longer waits for that: it took 30 s with a 30 s timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                             f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
                             "print('up', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        child = subprocess.Popen([sys.executable, "-c", "import sys; from olmo_chunks import _core; "
                                  f"hb = _core.Heartbeat('127.0.0.1', {port}, 'hb/x', 0.05, 30.0); "
                                  "print('beating', flush=True); sys.stdin.readline()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "beating"
    finally:
        host.kill()
        host.wait()
    time.sleep(0.5)  # the heartbeat finds the store gone and reconnects, in vain
    t0 = time.monotonic()
    child.communicate("exit\n", timeout=60)
    assert child.returncode == 0 and time.monotonic() - t0 < 10


def test_a_server_that_never_answers_ends_in_timeout_error():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        c = _core.StoreClient("127.0.0.1", port, 1.0)  # the kernel accepts; nobody reads
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer"):
            c.add("x", 1)
        assert time.monotonic() - t0 < 3
        with pytest.raises(ConnectionError, match="an earlier call failed"):
            c.check(["x"])


def test_a_refused_connection_is_a_connection_error_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        _core.StoreClient("127.0.0.1", port, 0.5)
    assert time.monotonic() - t0 < 3
    # The heartbeat's first connect too (it waited 120 s, whatever the timeout, for a store whose
    # host, rank 0, had died before this rank's first save: the survivor hung).
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        _core.Heartbeat("127.0.0.1", port, "hb/x", 0.05, 0.5)
    assert time.monotonic() - t0 < 3


def test_an_oversized_answer_is_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        c = _core.StoreClient("127.0.0.1", listener.getsockname()[1], 2.0)
        conn, _ = listener.accept()
        with conn:
            conn.sendall(struct.pack("<Q", 1 << 40))
            with pytest.raises(ConnectionError, match="value"):
                c.get("k")

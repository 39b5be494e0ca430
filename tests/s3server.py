"""A real S3-compatible server for the object-store tests: moto's server process on 127.0.0.1,
and a TCP relay in front of it that can die mid-request like a crashed server would.

The session fixture `s3` (conftest.py) starts one server for the whole session and stops it at
the end. Ranks of a gloo world get the client settings through `in_env`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1 (`moto_server.py`: conditional writes atomic),
    its clock `clock_offset` seconds from this machine's."""

    def __init__(self, clock_offset: float = 0.0) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "moto_server.py"), "127.0.0.1", str(self.port), str(clock_offset)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_listening(self.port, self.proc)

    def env(self, port: int | None = None, **extra: str) -> dict[str, str]:
        """The standard AWS variables that point a client at this server (or a relay on `port`)."""
        return {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port or self.port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
            **extra,
        }

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self) -> str:
        """A fresh, empty bucket."""
        name = f"b-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        return sorted(o["Key"] for o in self.client().list_objects_v2(Bucket=bucket).get("Contents", []))

    def close(self) -> None:
        stop(self.proc)


class Relay:
    """`tcp_relay.py` on `port` forwarding to `target`; with `die_after`, it exits abruptly once it
    has forwarded that many bytes towards the server; with `freeze_after`, it then forwards nothing
    more, holding every connection open (a server that accepts and never answers)."""

    def __init__(self, port: int, target: int, die_after: int | None = None,
                 freeze_after: int | None = None) -> None:
        cmd = [sys.executable, str(HERE / "tcp_relay.py"), str(port), str(target)]
        if die_after is not None:
            cmd.append(str(die_after))
        elif freeze_after is not None:
            cmd += [str(freeze_after), "freeze"]
        self.port = port
        self.proc = subprocess.Popen(cmd)
        wait_listening(port, self.proc)

    def wait_dead(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        stop(self.proc)


class FaultProxy:
    """`fault_proxy.py` on a free port in front of the server at `target`: the first `count`
    `method` requests for data objects get `fault`. `faults()` is how many it injected so far."""

    def __init__(self, target: int, fault: str, method: str, count: int) -> None:
        self.port = free_port()
        cmd = [sys.executable, str(HERE / "fault_proxy.py"), str(self.port), str(target), fault, method, str(count)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        wait_listening(self.port, self.proc)

    def close(self) -> int:
        """Stops the proxy; returns how many faults it injected."""
        stop(self.proc)
        assert self.proc.stdout is not None
        lines = self.proc.stdout.read().split()
        return int(lines[-1]) if lines else 0


def in_env(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Runs `fn(*args)` with `env` set (on a rank of a persistent world, which outlives tests)."""
    os.environ.update(env)
    return fn(*args)

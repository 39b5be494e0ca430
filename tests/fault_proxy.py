"""`python fault_proxy.py PORT TARGET FAULT METHOD COUNT`: an HTTP/1.1 proxy from 127.0.0.1:PORT to
the S3 server at 127.0.0.1:TARGET that answers the first COUNT METHOD requests for data objects
(keys ending in `.bin`) with FAULT, and relays everything else unchanged:

- `slowdown`: 503 SlowDown, as S3 throttles;
- `error500`: 500 InternalError;
- `short`: the server's status and headers, then half the body, then the connection closed;
- `long-length`: the body whole, under a Content-Length larger than it (the connection then closed);
- `other-range`: a ranged GET answered with the bytes of the range just after the one asked for,
  under a Content-Range that says so;
- `vanished`: a HEAD of a clock probe (`.olmo_chunks.clock-*`, not a data object) answered 404, as
  when another save's cleanup removed the probe between its PUT and its HEAD;
- `lost-commit`: a PUT of the manifest (not a data object) forwarded, so the server commits it, and
  never answered; every GET of the manifest then answered 1.3 s late;
- `late-commit`: a PUT of the manifest held 4.5 s before it is forwarded (its client has given up
  by then);
- `commit-500`: a PUT of the manifest forwarded, so the server commits it, and answered 500 (its
  client retries it, and the retry's condition fails).

Each request is forwarded on a fresh upstream connection; the client's connection is kept alive.
It prints `faults N` on stdout after each fault it injects.
"""

from __future__ import annotations

import asyncio
import re
import sys

S3_ERROR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{msg}</Message></Error>"


async def read_message(reader: asyncio.StreamReader,
                       body: bool = True) -> tuple[bytes, dict[str, str], bytes] | None:
    """One HTTP message: its start line, headers (lower-cased names) and body (by Content-Length;
    none if not `body`, as for the answer to a HEAD)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    start, *lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines:
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0")) if body else 0
    return start, headers, await reader.readexactly(n) if n else b""


def serialize(start: bytes, headers: dict[str, str], body: bytes) -> bytes:
    out = start + b"\r\n" + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
    return out + b"\r\n" + body


class Proxy:
    """Forwards requests to the server at `target`, injecting `fault` into the first `count`
    requests for data objects."""

    def __init__(self, target: int, fault: str, method: str, count: int) -> None:
        self.target, self.fault, self.method, self.left = target, fault, method, count
        self.done = 0

    async def upstream(self, start: bytes, headers: dict[str, str], body: bytes) -> tuple[bytes, dict[str, str], bytes]:
        r, w = await asyncio.open_connection("127.0.0.1", self.target)
        w.write(serialize(start, {**headers, "connection": "close"}, body))
        await w.drain()
        got = await read_message(r, body=not start.startswith(b"HEAD "))
        w.close()
        assert got is not None
        return got

    def take(self, applies: bool) -> str | None:
        """The fault for a request it `applies` to, if it is one of the first `count` (taken at once:
        requests run concurrently)."""
        if not (applies and self.left > 0):
            return None
        self.left -= 1
        return self.fault

    def injected(self, answer: bytes, close: bool) -> tuple[bytes, bool]:
        self.done += 1
        print(f"faults {self.done}", flush=True)
        return answer, close

    async def answer(self, start: bytes, headers: dict[str, str], body: bytes) -> tuple[bytes, bool]:
        """The bytes to answer one request with, and whether to close the connection after them."""
        method, path, _ = start.decode("latin-1").split(" ", 2)
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", headers.get("range", "")) if method == "GET" else None
        a, b = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
        n = b - a + 1
        # other-range answers with the range just before the one asked for, of the same length.
        key = path.split("?", 1)[0]
        if self.fault == "lost-commit" and key.endswith("/olmo_chunks.manifest"):
            if method == "PUT" and self.take(True):
                await self.upstream(start, headers, body)
                self.injected(b"", False)
                await asyncio.sleep(3600)  # the answer never comes
            if method == "GET":
                await asyncio.sleep(1.3)
        manifest_put = key.endswith("/olmo_chunks.manifest") and method == "PUT"
        if self.fault == "late-commit" and manifest_put and self.take(True):
            await asyncio.sleep(4.5)
            self.injected(b"", False)
        if self.fault == "commit-500" and manifest_put and self.take(True):
            await self.upstream(start, headers, body)
            msg = S3_ERROR.format(code="InternalError", msg="injected").encode()
            return self.injected(serialize(b"HTTP/1.1 500 Internal Server Error", {
                "content-type": "application/xml", "content-length": str(len(msg))}, msg), False)
        wanted = ".olmo_chunks.clock-" in key if self.fault == "vanished" else key.endswith(".bin")
        applies = wanted and method == self.method and (
            self.fault != "other-range" or (m is not None and a >= n > 0))
        fault = self.take(applies)
        if fault == "vanished":
            return self.injected(serialize(b"HTTP/1.1 404 Not Found", {"content-length": "0"}, b""), False)
        if fault in ("slowdown", "error500"):
            status, code = (b"HTTP/1.1 503 Slow Down", "SlowDown") if fault == "slowdown" else (
                b"HTTP/1.1 500 Internal Server Error", "InternalError")
            msg = S3_ERROR.format(code=code, msg="injected").encode()
            return self.injected(serialize(status, {"content-type": "application/xml",
                                                    "content-length": str(len(msg))}, msg), False)
        if fault == "other-range":
            got = await self.upstream(start, {**headers, "range": f"bytes={a - n}-{a - 1}"}, body)
            return self.injected(serialize(*got), False)
        rstart, rheaders, rbody = await self.upstream(start, headers, body)
        if fault in ("short", "long-length") and len(rbody) > 1:
            if fault == "short":
                return self.injected(serialize(rstart, rheaders, rbody[: len(rbody) // 2]), True)
            longer = {**rheaders, "content-length": str(len(rbody) + 100)}
            return self.injected(serialize(rstart, longer, rbody), True)
        if fault is not None:
            self.left += 1  # a request this fault could not be applied to: it goes to a later one
        return serialize(rstart, rheaders, rbody), False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (req := await read_message(reader)) is not None:
                data, close = await self.answer(*req)
                writer.write(data)
                await writer.drain()
                if close:
                    break
        except ConnectionError:
            pass
        finally:
            writer.close()


async def main(port: int, target: int, fault: str, method: str, count: int) -> None:
    proxy = Proxy(target, fault, method, count)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])))

"""`python tcp_relay.py PORT TARGET [LIMIT [die|freeze]]`: relays TCP connections from 127.0.0.1:PORT
to 127.0.0.1:TARGET. With LIMIT, once it has relayed that many bytes towards TARGET it either exits
at once (`die`, the default; no goodbye on any connection): to the client, a server that crashed
mid-request; or stops relaying anything on any connection, old or new, while keeping them open
(`freeze`): to the client, a server that accepts and never answers."""

import asyncio
import os
import sys


async def main(port: int, target: int, limit: int | None, mode: str) -> None:
    sent = 0
    frozen = asyncio.Event()

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
        nonlocal sent
        try:
            while data := await src.read(1 << 16):
                if frozen.is_set():
                    await asyncio.Event().wait()  # hold the connection, forward nothing, forever
                if upstream:
                    sent += len(data)
                    if limit is not None and sent >= limit:
                        if mode == "die":
                            os._exit(17)
                        frozen.set()
                        continue
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if frozen.is_set():
            await asyncio.Event().wait()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(int(args[0]), int(args[1]), int(args[2]) if len(args) > 2 else None,
                     args[3] if len(args) > 3 else "die"))

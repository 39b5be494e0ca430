"""`python tcp_relay.py PORT TARGET [DIE_AFTER]`: relays TCP connections from 127.0.0.1:PORT to
127.0.0.1:TARGET. With DIE_AFTER, the process exits at once (no goodbye on any connection) when it
has relayed that many bytes towards TARGET: to the client, a server that crashed mid-request."""

import asyncio
import os
import sys


async def main(port: int, target: int, die_after: int | None) -> None:
    sent = 0

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
        nonlocal sent
        try:
            while data := await src.read(1 << 16):
                if upstream:
                    sent += len(data)
                    if die_after is not None and sent >= die_after:
                        os._exit(17)
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
    args = [int(a) for a in sys.argv[1:]]
    asyncio.run(main(args[0], args[1], args[2] if len(args) > 2 else None))

"""A TCP relay that holds every byte for a set time in each direction: latency where netem is absent.

    python tests/delay_proxy.py --listen 10.77.0.1:4001 --to 127.0.0.1:4000 --delay 0.1

Every connection accepted on ``--listen`` is joined to a new connection to ``--to``; what one side sends
reaches the other ``--delay`` seconds later, in order, half-closes included. It reads as fast as the
sender sends (the link's rate is the namespace's ``tc tbf``, not this relay's), so it adds delay and
nothing else. Prints ``{"ready": port}`` once listening (``--listen`` port 0: a free one).
"""

from __future__ import annotations

import argparse
import asyncio
import json

CHUNK = 1 << 16


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    held: asyncio.Queue = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await held.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:  # the sender's end of stream, as late as its last bytes
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    releasing = asyncio.create_task(release())
    try:
        while True:
            data = await reader.read(CHUNK)
            held.put_nowait((loop.time() + delay, data))
            if not data:
                break
        await releasing
    except (ConnectionError, OSError):
        releasing.cancel()


async def _join(delay: float, to: tuple[str, int], reader, writer) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(*to)
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(_pump(reader, up_writer, delay), _pump(up_reader, writer, delay))
    finally:
        for w in (writer, up_writer):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(listen: tuple[str, int], to: tuple[str, int], delay: float) -> None:
    server = await asyncio.start_server(lambda r, w: _join(delay, to, r, w), *listen)
    print(json.dumps({"ready": server.sockets[0].getsockname()[1]}), flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_address, required=True, help="host:port to accept on")
    parser.add_argument("--to", type=_address, required=True, help="host:port to connect to")
    parser.add_argument("--delay", type=float, required=True, help="seconds, each direction")
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.to, args.delay))


if __name__ == "__main__":
    main()

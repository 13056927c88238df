"""CPU of relaying streamed replies, the upstream side alone: `Upstream.chunks` with and without
holding reads while a batch waits (`RouterConfig.stream_batching_hold_reads`).

A token writer in a child process (so its CPU is not counted) answers every request with an SSE
stream of `--tokens` events, one write each, `--gap-ms` apart, like an engine streaming one token
per decode step. This process opens `--streams` such requests, `--concurrency` at a time, through
`serve_app.proxy.UpstreamClient` on uvloop, relays each with the router's batching interval, and
prints its own CPU time per stream, its reads (`data_received` calls) per stream, and the stream
end's delay after the worker's last write, per mode. Nothing is asserted; run it on a quiet machine:

    python -m bench.relay [--streams 400 --concurrency 20 --tokens 44 --gap-ms 12 --interval-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import time

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
         b"connection: keep-alive\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _writer(port_out: "mp.connection.Connection", tokens: int, gap_s: float) -> None:
    """The token writer: minimal HTTP/1.1 keep-alive server, one chunk per token."""
    import uvloop

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    if length:
                        await reader.readexactly(length)
                    writer.write(_HEAD)
                    for i in range(tokens):
                        writer.write(_chunk(b'data: {"i": %d, "text": "token"}\n\n' % i))
                        await asyncio.sleep(gap_s)
                    # the end: the [DONE] event and the chunked terminator, stamped for the delay figure
                    writer.write(_chunk(b"data: [DONE] %.6f\n\n" % time.time()) + b"0\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_out.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    uvloop.run(main())


async def _relay(url: str, streams: int, concurrency: int, interval_s: float, hold: bool) -> dict[str, float]:
    from serve_app import proxy

    reads = [0]
    original = proxy._Connection.data_received

    def counting(self, data):  # type: ignore[no-untyped-def]
        reads[0] += 1
        return original(self, data)

    proxy._Connection.data_received = counting  # type: ignore[method-assign]
    client = proxy.UpstreamClient(5.0, 30.0)
    delays: list[float] = []
    pieces = [0]
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            up = await client.open("w", "POST", url, content=b"{}")
            last = b""
            async for piece in up.chunks(interval_s, hold_reads=hold):
                pieces[0] += 1
                last = piece
            end = time.time()
            await up.close()
            stamp = last.rsplit(b"[DONE] ", 1)[1].split(b"\n", 1)[0]
            delays.append(end - float(stamp))

    try:
        await one()  # warm: connection, imports
        reads[0] = pieces[0] = 0
        delays.clear()
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(one() for _ in range(streams)))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    finally:
        proxy._Connection.data_received = original  # type: ignore[method-assign]
        await client.aclose()
    return {"cpu_ms_per_stream": cpu / streams * 1e3, "reads_per_stream": reads[0] / streams,
            "pieces_per_stream": pieces[0] / streams, "end_delay_ms_p50": statistics.median(delays) * 1e3,
            "end_delay_ms_max": max(delays) * 1e3, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--tokens", type=int, default=44)
    p.add_argument("--gap-ms", type=float, default=12.0)
    p.add_argument("--interval-ms", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=2, help="alternating off/on rounds")
    args = p.parse_args(argv)
    import uvloop

    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_writer, args=(tx, args.tokens, args.gap_ms / 1e3), daemon=True)
    proc.start()
    try:
        port = rx.recv()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        socket.create_connection(("127.0.0.1", port)).close()
        print(f"{args.streams} streams × {args.tokens} tokens {args.gap_ms:g} ms apart, {args.concurrency} at a "
              f"time, batching interval {args.interval_ms:g} ms")
        for r in range(args.rounds):
            for hold in (False, True):
                res = uvloop.run(_relay(url, args.streams, args.concurrency, args.interval_ms / 1e3, hold))
                print(f"round {r + 1} hold_reads={str(hold):5}: CPU {res['cpu_ms_per_stream']:.3f} ms/stream, "
                      f"{res['reads_per_stream']:.1f} reads, {res['pieces_per_stream']:.1f} pieces per stream, "
                      f"end delay p50 {res['end_delay_ms_p50']:.1f} ms (max {res['end_delay_ms_max']:.1f}), "
                      f"wall {res['wall_s']:.1f} s")
        with open("/proc/loadavg") as f:
            print("loadavg", f.read().strip())
    finally:
        proc.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A TCP forwarder that adds one-way delay and a rate limit per direction.

The UDP relay (``engine.net.wan_emulator``) makes WebRTC links look like the
internet; the coordinator's websockets are TCP, so they get this instead: every
connection accepted on the proxy's address is forwarded to ``target``, bytes
client -> target shaped by ``upstream`` and target -> client by ``downstream``
(an :class:`~engine.net.wan_emulator.ImpairmentProfile`: ``delay_ms`` and
``bandwidth_mbps`` are used; loss is refused, TCP would repair it invisibly on
loopback; jitter is ignored, TCP keeps order). Chunks keep their order: each
leaves after the one ahead at the line rate, then arrives ``delay_ms`` later.
Each direction buffers at most :data:`QUEUE_CHUNKS` chunks of up to
:data:`CHUNK_BYTES`; beyond that it stops reading (TCP backpressure to the sender).

What this module does not know: HTTP, websockets, or who the ends are.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engine.net.wan_emulator import Address, ImpairmentProfile

log = logging.getLogger(__name__)

#: most bytes read at once from either end
CHUNK_BYTES = 64 * 1024
#: chunks a direction may hold in flight (delay line + rate queue) before it stops reading
QUEUE_CHUNKS = 64
#: seconds to open the connection to the target
CONNECT_TIMEOUT_S = 10.0


@dataclass
class ProxyCounters:
    connections: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    failed_connects: int = 0


class _Direction:
    """Departure times of one direction's chunks: FIFO at the line rate, then the delay."""

    def __init__(self, profile: ImpairmentProfile) -> None:
        self.delay_s = profile.delay_ms / 1e3
        self.rate_bytes_s = profile.bandwidth_mbps * 1e6 / 8 if profile.bandwidth_mbps else None
        self._line_free_at = 0.0

    def delivery(self, nbytes: int, now: float) -> float:
        departure = now
        if self.rate_bytes_s is not None:
            departure = max(now, self._line_free_at) + nbytes / self.rate_bytes_s
            self._line_free_at = departure
        return departure + self.delay_s


class TcpDelayProxy:
    """``await start()`` returns the address to connect to instead of ``target``; ``await close()``."""

    def __init__(self, target: Address, upstream: ImpairmentProfile, downstream: ImpairmentProfile | None = None,
                 *, host: str = "127.0.0.1", port: int = 0) -> None:
        downstream = downstream or upstream
        for profile in (upstream, downstream):
            if profile.loss_percent:
                raise ValueError("a TCP proxy cannot emulate loss (TCP repairs it); use delay and rate only")
        self.target = (str(target[0]), int(target[1]))
        self.upstream, self.downstream = upstream, downstream
        self.host, self.port = host, port
        self.counters = ProxyCounters()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.address: Address = ("", 0)

    async def start(self) -> Address:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self.address

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            self.counters.failed_connects += 1
            log.info("tcp proxy: cannot reach %s: %s", self.target, exc)
            writer.close()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        self.counters.connections += 1
        n = self.counters.connections
        up = self._spawn(self._pump(reader, up_writer, _Direction(self.upstream), "bytes_up", f"tcp-proxy-up-{n}"),
                         f"tcp-proxy-up-{n}")
        down = self._spawn(self._pump(up_reader, writer, _Direction(self.downstream), "bytes_down",
                                      f"tcp-proxy-down-{n}"), f"tcp-proxy-down-{n}")
        await asyncio.gather(up, down, return_exceptions=True)
        for w in (writer, up_writer):
            w.close()
            self._writers.discard(w)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction,
                    counter: str, name: str) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            try:
                while data := await reader.read(CHUNK_BYTES):
                    await queue.put((direction.delivery(len(data), loop.time()), data))
            except (ConnectionError, OSError):
                pass
            finally:
                await queue.put((direction.delivery(0, loop.time()), b""))  # end of stream, behind everything read

        reading = self._spawn(read(), f"{name}-read")
        try:
            while True:
                when, data = await queue.get()
                delay = when - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                setattr(self.counters, counter, getattr(self.counters, counter) + len(data))
        except (ConnectionError, OSError):
            return
        finally:
            reading.cancel()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> "TcpDelayProxy":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

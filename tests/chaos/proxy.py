"""A fault-injecting TCP proxy on loopback: one listening port per peer, each forwarding to the broker.

Each peer's ``broker_endpoint`` points at its own :class:`Link`, so a fault can
hit one peer's connection (or all of them) while the others keep flowing. The
proxy runs its own asyncio loop in a daemon thread; the control methods are
thread-safe and return at once.

Modes of a link (bytes are never altered, so ZMTP framing stays intact):

``pass``       forward both ways.
``delay``      forward each chunk ``delay_s`` after it arrived (order kept).
``blackhole``  forward nothing, close nothing (no FIN, no RST): what a peer sees
               when a route dies. New connections are accepted and left dangling.
               Ending a blackhole either resumes the held bytes (the route came
               back) or resets the connections (a NAT entry timed out).

One-shot faults: :meth:`FaultProxy.reset` (RST every connection of a link) and
:meth:`FaultProxy.cut` (close them with FIN).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterable

CHUNK_BYTES = 65536
CONNECT_TIMEOUT_S = 2.0


class _Conn:
    """One proxied connection: the peer's side and the broker's side."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter | None) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task] = []

    def close(self, *, rst: bool) -> None:
        for w in (self.client, self.upstream):
            if w is None:
                continue
            if rst:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:
                        pass
                w.transport.abort()
            else:
                w.close()
        for t in self.tasks:
            t.cancel()


class Link:
    """One listening port (for one peer) -> the broker. Owned by the proxy loop."""

    def __init__(self, name: str, upstream_port: int) -> None:
        self.name = name
        self.upstream_port = upstream_port
        self.port = 0
        self.mode = "pass"
        self.delay_s = 0.0
        self.conns: set[_Conn] = set()
        self.resumed: asyncio.Event = asyncio.Event()
        self.resumed.set()
        self.server: asyncio.AbstractServer | None = None
        self.bytes_forwarded = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def set_mode(self, mode: str, delay_s: float = 0.0) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode == "blackhole":
            self.resumed.clear()
        else:
            self.resumed.set()

    def drop_all(self, *, rst: bool) -> None:
        for c in list(self.conns):
            c.close(rst=rst)
        self.conns.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer, None)
        self.conns.add(conn)
        try:
            await self.resumed.wait()  # a blackholed route: the SYN "reached" nobody
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.upstream_port), CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                conn.close(rst=True)  # broker down: connection refused, as the peer would see it
                return
            conn.upstream = up_writer
            conn.tasks = [asyncio.ensure_future(self._pump(reader, up_writer, conn)),
                          asyncio.ensure_future(self._pump(up_reader, writer, conn))]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            self.conns.discard(conn)
            conn.close(rst=False)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Conn) -> None:
        """Copy src -> dst honouring the link's mode; ends (and closes both) at EOF or error."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def writer() -> None:
            try:
                while True:
                    due, data = await queue.get()
                    wait = due - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await self.resumed.wait()
                    if not data:
                        dst.write_eof() if dst.can_write_eof() else dst.close()
                        return
                    dst.write(data)
                    self.bytes_forwarded += len(data)
                    await dst.drain()
            except (OSError, RuntimeError):  # the other side went away: the connection is over
                conn.close(rst=False)

        w = asyncio.ensure_future(writer())
        try:
            while True:
                data = await src.read(CHUNK_BYTES)
                due = time.monotonic() + (self.delay_s if self.mode == "delay" else 0.0)
                queue.put_nowait((due, data))
                if not data:
                    break
            await w
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            pass
        finally:
            if not w.done():
                w.cancel()
            conn.close(rst=False)


class FaultProxy:
    """Links named after peers, all forwarding to ``127.0.0.1:upstream_port``.

    ``start()`` binds every link (their ``port`` is then known); control methods
    may be called from any thread. ``close()`` stops the loop.
    """

    def __init__(self, upstream_port: int, names: Iterable[str]) -> None:
        self.upstream_port = upstream_port
        self.names = list(names)
        self.loop = asyncio.new_event_loop()
        self.links: dict[str, Link] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-proxy", daemon=True)

    def start(self) -> "FaultProxy":
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        for name in self.names:
            link = Link(name, self.upstream_port)
            await link.start()
            self.links[name] = link

    def _call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _soon(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def port(self, name: str) -> int:
        return self.links[name].port

    def set_mode(self, name: str, mode: str, delay_s: float = 0.0) -> None:
        """``mode``: pass | delay | blackhole (see module doc)."""
        if mode not in ("pass", "delay", "blackhole"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        self._soon(self.links[name].set_mode, mode, delay_s)

    def reset(self, name: str) -> None:
        """RST every current connection of ``name`` (the peer reconnects)."""
        self._soon(lambda: self.links[name].drop_all(rst=True))

    def cut(self, name: str) -> None:
        """Close every current connection of ``name`` with FIN."""
        self._soon(lambda: self.links[name].drop_all(rst=False))

    def end_blackhole(self, name: str, *, reset: bool) -> None:
        """Leave blackhole mode: resume the held bytes, or reset the held connections first."""
        def go() -> None:
            link = self.links[name]
            if reset:
                link.drop_all(rst=True)
            link.set_mode("pass")
        self._soon(go)

    def heal_all(self) -> None:
        for name in self.names:
            self.set_mode(name, "pass")

    def close(self) -> None:
        async def stop() -> None:
            for link in self.links.values():
                link.drop_all(rst=True)
                if link.server is not None:
                    link.server.close()
        try:
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

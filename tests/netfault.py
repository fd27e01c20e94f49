"""A network fault between a client and a real server: a TCP relay that can sever every
connection it carries (or the one carrying a chosen command) and refuse new ones for a while,
as a broken link or a partition would; the server itself runs on, untouched."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time


class Relay:
    """Relays 127.0.0.1:`port` to the server on `upstream_port`, in a thread of its own.

    `sever(down_s)` cuts every connection now and refuses new ones for `down_s`; with `cut_on`
    set and `armed`, the first connection to send bytes containing it is severed so, before
    they reach the server (then `armed` is cleared and `cut_at` says when)."""

    def __init__(self, upstream_port: int, cut_on: bytes = b"", down_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.cut_on = cut_on
        self.down_s = down_s
        self.armed = False
        self.cut_at: float | None = None
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="relay", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def __enter__(self) -> Relay:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def down(self) -> bool:
        return self.cut_at is not None and time.monotonic() < self.cut_at + self.down_s

    def sever(self, down_s: float) -> None:
        """Cut every connection now; refuse new ones for `down_s` (callable from any thread)."""
        self.down_s = down_s
        self.cut_at = time.monotonic()
        self._loop.call_soon_threadsafe(self._close_all)

    def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.close()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, family=socket.AF_INET)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down():
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pair = (writer, up_writer)
        self._writers.update(pair)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, cut: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if cut and self.armed and self.cut_on and self.cut_on in data:
                        self.armed = False
                        self.cut_at = time.monotonic()
                        break
                    if self.down():
                        break
                    dst.write(data)
                    await dst.drain()
            for w in pair:
                w.close()
                self._writers.discard(w)

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

"""nats-py's client with a cheaper path for the messages the queue sends and receives most.

Per job a consumer receives a pulled message and two publish answers and sends a record write,
a Finished event and an ack; each cost nats-py some 10-15 µs of Python. Here:

- answers on the one long-lived reply subscription go straight to a plain callback from the
  read loop: no `Msg` built for a publish answer, no queue and no subscription task between
  the socket and the waiting future (`raw`);
- a publish with headers builds its command in one go (`publish_now`), with the checks that
  matter kept: the subject's whitespace and CR/LF refused, CR/LF in header values blanked;
- what a call writes for many jobs (a claim's records, a completion's Finished events, an
  enqueue's lane messages) goes into nats-py's buffer as one write (`publish_all`):
  every command built, and any refused, before one is written;
- the header parser is nats-py's result at a third of its cost.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence

import nats.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg

log = logging.getLogger(__name__)

# (subject, reply, data, headers) of a message on a raw subscription
RawHandler = Callable[[bytes, bytes, bytes, dict[str, str] | None], None]

# (subject, payload, reply subject or "", headers) of a message to publish
Outgoing = tuple[str, bytes, str, Mapping[str, str] | None]

_NO_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_BAD_SUBJECT = re.compile(r"[ \t\r\n]")  # CR/LF in a subject would be a command of its own


class Client(_NatsClient):
    def __init__(self) -> None:
        super().__init__()
        self._raw: dict[int, RawHandler] = {}

    def on_raw(self, sid: int, handler: RawHandler) -> None:
        """Messages of subscription `sid` go to `handler`, called from the read loop (it must
        not block), in place of the subscription's callback."""
        self._raw[sid] = handler

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        handler = self._raw.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        stats = self.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        try:
            handler(subject, reply, data, await self._process_headers(headers) if headers else None)
        except Exception:  # an error here would end nats-py's read loop, the connection with it
            log.exception(
                "nats: a message on %s could not be handled", subject.decode(errors="replace")
            )

    async def publish_now(
        self, subject: str, payload: bytes, reply: str, headers: Mapping[str, str] | None
    ) -> None:
        """`publish` for subjects this backend names (headers its own constant names); the
        same refusals where they matter (a closed or draining connection, a full buffer while
        reconnecting, a payload over the server's limit, whitespace in the subject)."""
        await self._write(self._command(subject, payload, reply, headers), len(payload), 1)

    async def publish_all(self, messages: Sequence[Outgoing]) -> None:
        """`publish_now` of each message, in order, as one write into nats-py's buffer: every
        command is built (and refused) before any is written, so all go or none does. Per
        message this saves the checks, the buffer append and the flush request of a call each
        (a claim's records, a completion's Finished events and acks, an enqueue's messages)."""
        if not messages:
            return
        commands = [self._command(*message) for message in messages]
        size = sum(len(message[1]) for message in messages)
        await self._write(b"".join(commands), size, len(messages))

    def _command(
        self, subject: str, payload: bytes, reply: str, headers: Mapping[str, str] | None
    ) -> bytes:
        """One PUB or HPUB command; refuses what nats-py's `publish` refuses of a message."""
        if not subject or _BAD_SUBJECT.search(subject):
            raise nats.errors.BadSubjectError
        size = len(payload)
        if size > self._max_payload:
            raise nats.errors.MaxPayloadError
        if headers:
            lines = []
            for key, value in headers.items():
                value = value.strip()
                # translate looks each character up in a dict: ~1 µs a header, so only when due
                if "\r" in value or "\n" in value:
                    value = value.translate(_NO_NEWLINES)
                lines.append(f"{key}: {value}\r\n")
            hdr = f"NATS/1.0\r\n{''.join(lines)}\r\n".encode()
            return b"".join(
                (
                    f"HPUB {subject} {reply} {len(hdr)} {len(hdr) + size}\r\n".encode(),
                    hdr,
                    payload,
                    b"\r\n",
                )
            )
        head = f"PUB {subject} {reply} {size}\r\n" if reply else f"PUB {subject} {size}\r\n"
        return b"".join((head.encode(), payload, b"\r\n"))

    async def _write(self, command: bytes, size: int, count: int) -> None:
        """Commands into nats-py's buffer, unless the connection refuses them (closed,
        draining, or a full buffer while reconnecting); `size`: their payloads' bytes."""
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        if not self.is_connected and (
            self._max_pending_size <= 0 or size + self._pending_data_size > self._max_pending_size
        ):
            raise nats.errors.OutboundBufferLimitError
        self.stats["out_msgs"] += count
        self.stats["out_bytes"] += size
        await self._send_command(command)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        """nats-py's parser tested every character of every header name (each message a claim
        reads has seven headers: a sixth of a consumer's time). Same result: a name with
        whitespace inside is skipped, values are stripped and decoded leniently."""
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if len(key.split()) > 1:  # whitespace inside the (stripped) name
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out


def delivered(msg: Msg) -> tuple[str, int]:
    """(stream, stream sequence) of a delivered message, from its ack subject:
    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.` and 3 more tokens, or with a domain
    and an account hash before the stream (nats-py's `metadata` builds a timestamp and four
    objects for it)."""
    parts = (msg.reply or "").split(".")
    if len(parts) == 9:
        return parts[2], int(parts[5])
    metadata = msg.metadata
    return metadata.stream, int(metadata.sequence.stream)

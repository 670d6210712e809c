"""uvicorn's h11 HTTP/1.1 protocol with a deadline on each request's head, and JSON for
a head it cannot read.

uvicorn closes an idle keep-alive connection after a response, but a connection that
never completes its first request head (one that sends nothing, or its headers a byte at
a time: slowloris) stays open for ever: enough of them use up the process's file
descriptors, and then ``accept`` fails for everyone (``/health`` included). Here the
head of a request must arrive whole within :data:`HEAD_TIMEOUT_S` of the connection
opening, or of its first byte on a kept-alive connection (nginx's
``client_header_timeout``); a late one gets a 408 and the connection closes. The body
has its own idle deadline (``http_api.BODY_IDLE_TIMEOUT_S``).

A head h11 cannot parse is a 400 (malformed) or a 431 (request line and headers over
:data:`MAX_HEAD_BYTES`) with OpenAI's JSON error body naming that, instead of uvicorn's
plain-text 400 "Invalid HTTP request received.".
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 30.0
# request line and headers (h11's max_incomplete_event_size; uvicorn's default is 16 KiB):
# headers up to http_api.MAX_HEADER_BYTES reach the app (a 431 past them), the request line 16 KiB more
MAX_HEAD_BYTES = 80 * 1024


def _raw_error(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """:class:`H11Protocol` with the head deadline and the JSON 400 (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received while no request head has been read whole

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_timer is None:  # the first byte of a kept-alive connection's next head
                self._arm_head()
        else:  # the head is in (or the connection is done)
            self._cancel_head()
            self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is not h11.IDLE:  # a pipelined request's head was already buffered
            self._cancel_head()

    def send_400_response(self, msg: str) -> None:
        self._cancel_head()
        if self._head_bytes > MAX_HEAD_BYTES:
            error = _raw_error(431, "Request Header Fields Too Large", (
                f"the request line and headers have more than {MAX_HEAD_BYTES} bytes; allowed: at most "
                f"{MAX_HEAD_BYTES} (a long query string belongs in a JSON body)"))
        else:
            error = _raw_error(400, "Bad Request", (
                f"invalid HTTP request: the request line and headers must be well-formed HTTP/1.1 of at most "
                f"{MAX_HEAD_BYTES} bytes"))
        self.transport.write(error)
        self.transport.close()

    def _arm_head(self) -> None:
        self._cancel_head()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_expired)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._unset_keepalive_if_required()
        self.transport.write(_raw_error(408, "Request Timeout", (
            f"the request line and headers did not arrive within {HEAD_TIMEOUT_S:g} s; send them whole")))
        self.transport.close()

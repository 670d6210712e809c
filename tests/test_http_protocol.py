"""The HTTP protocol the server runs (runtime/server/http_protocol.py): a request head
that does not arrive whole in time gets a 408 and the connection closes (a connection
that never sent a head stayed open for ever: enough of them used up the server's file
descriptors, /health included); a head h11 cannot read is a JSON 400. Checked on a
uvicorn server in this process with a short deadline, and on a real plait server."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from plait.runtime.server import http_protocol
from plait.runtime.server.http_protocol import MAX_HEAD_BYTES, GuardedH11Protocol
from plait.runtime.server.serve import _Server, bind_http

DEADLINE = 0.6


async def app(scope, receive, send):
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    out = json.dumps({"path": scope["path"], "query": len(scope["query_string"]), "body": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def server():
    mp = pytest.MonkeyPatch()
    mp.setattr(http_protocol, "HEAD_TIMEOUT_S", DEADLINE)
    sock = bind_http("127.0.0.1", 0)
    srv = _Server(uvicorn.Config(app, log_level="error", lifespan="off", timeout_keep_alive=30,
                                 http=GuardedH11Protocol, h11_max_incomplete_event_size=MAX_HEAD_BYTES))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    srv.should_exit = True
    t.join(10)
    mp.undo()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _read_one(s: socket.socket) -> bytes:
    """One response on a kept-alive connection (its head and content-length bytes)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def _get(path: str = "/x") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode()


def test_a_connection_that_sends_no_head_is_closed_with_a_408(server):
    s = _connect(server)
    t0 = time.monotonic()
    status, body = _response(_read_all(s))
    assert status == 408 and "did not arrive" in body["error"]["message"]
    assert DEADLINE * 0.9 <= time.monotonic() - t0 < 10


def test_a_head_sent_a_byte_at_a_time_does_not_keep_the_connection(server):
    s = _connect(server)
    head = b"GET /x HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 1000
    t0 = time.monotonic()
    for i, byte in enumerate(head):
        try:
            s.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.05)
        if time.monotonic() - t0 > 5:
            break
    s.settimeout(5)
    raw = _read_all(s)
    assert time.monotonic() - t0 < 5  # the bytes kept coming; the deadline held
    assert _response(raw)[0] == 408


def test_requests_and_an_idle_kept_alive_connection_are_not_cut(server):
    s = _connect(server)
    s.sendall(_get("/one"))
    first = _read_one(s)
    assert first.startswith(b"HTTP/1.1 200") and b'"/one"' in first
    time.sleep(DEADLINE * 2)  # idle between requests: the keep-alive timeout (30 s) governs, not the head's
    s.sendall(_get("/two"))
    second = _read_one(s)
    assert second.startswith(b"HTTP/1.1 200") and b'"/two"' in second
    # a body that takes longer than the head's deadline is the app's to time (its own 408)
    s.sendall(b"POST /three HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nab")
    time.sleep(DEADLINE * 2)
    s.sendall(b"cd")
    third = _read_one(s)
    assert third.startswith(b"HTTP/1.1 200") and b'"body": 4' in third
    s.close()


def test_a_long_query_string_is_read_an_oversized_head_is_a_431_and_a_bad_one_a_400(server):
    s = _connect(server)
    s.sendall(_get("/q?" + "a" * (60 * 1024)))
    raw = _read_one(s)
    assert raw.startswith(b"HTTP/1.1 200") and b'"query": 61440' in raw
    s.close()
    s = _connect(server)
    # (h11 refuses a head once more than that is buffered incomplete: no end of head is sent,
    # so the server has read all there is when it answers, and closing does not reset)
    s.sendall(b"GET /q?" + b"a" * (MAX_HEAD_BYTES + 4096))
    status, body = _response(_read_all(s))
    assert status == 431 and str(MAX_HEAD_BYTES) in body["error"]["message"]
    s = _connect(server)
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, body = _response(_read_all(s))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"

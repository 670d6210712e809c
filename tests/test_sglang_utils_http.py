"""``plait.utils.http_request`` and ``download_and_cache_file``: the HTTP helpers SGLang's
scripts import from ``sglang.utils`` (examples/frontend_language/usage/json_logprobs.py,
benchmark/gsm8k and hellaswag's bench_sglang.py), against a local HTTP server."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from plait.utils import HttpResponse, download_and_cache_file, http_request

FILE = "".join(f"line {i}: é\n" for i in range(5000)).encode()


class Handler(BaseHTTPRequestHandler):
    hits: dict[str, int] = {}

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        Handler.hits[self.path] = Handler.hits.get(self.path, 0) + 1
        if self.path == "/get_model_info":
            self._reply(200, json.dumps({"model_path": "m", "method": "GET"}).encode())
        elif self.path == "/data/set.jsonl":
            self._reply(200, FILE, "application/octet-stream")
        else:
            self._reply(404, json.dumps({"error": {"message": f"no route {self.path}"}}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        if self.path == "/stream":  # server-sent events, written one by one
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {json.dumps({'i': i, 'text': 'é' * i})}\r\n\r\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        self._reply(200, json.dumps({"got": body, "auth": self.headers.get("Authorization"),
                                     "method": self.command}).encode())


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_json_body_is_posted_and_the_reply_read_as_sglangs_scripts_read_it(url):
    r = http_request(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}}, api_key="k1")
    assert isinstance(r, HttpResponse) and r.status_code == 200 and r.ok
    assert r.json() == {"got": {"text": "hi", "sampling_params": {"max_new_tokens": 4}}, "auth": "Bearer k1",
                        "method": "POST"}
    assert json.loads(r.text) == r.json() and r.headers["Content-Type"] == "application/json"
    # no body: a GET (SGLang's /get_model_info calls), or the method asked for
    assert http_request(url + "/get_model_info").json() == {"model_path": "m", "method": "GET"}
    assert http_request(url + "/flush", json={}, method="POST").json()["method"] == "POST"


def test_an_error_status_is_a_reply_not_an_exception(url):
    r = http_request(url + "/nowhere")
    assert r.status_code == 404 and not r.ok and r.json()["error"]["message"] == "no route /nowhere"
    with pytest.raises(urllib.error.HTTPError):
        r.raise_for_status()


def test_a_streamed_reply_is_read_line_by_line_as_it_arrives(url):
    r = http_request(url + "/stream", json={"stream": True}, stream=True)
    assert r.status_code == 200
    events = [line for line in r.iter_lines(decode_unicode=False) if line]
    assert events[-1] == b"data: [DONE]"
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == [0, 1, 2]
    assert json.loads(events[2][6:].decode())["text"] == "éé"  # whole characters, no \r left
    r = http_request(url + "/stream", json={"stream": True}, stream=True)
    assert b"".join(r.iter_content(chunk_size=7)).count(b"data: ") == 4


def test_a_file_is_downloaded_once_and_then_read_from_disk(url, tmp_path):
    target = tmp_path / "set.jsonl"
    before = Handler.hits.get("/data/set.jsonl", 0)
    assert download_and_cache_file(url + "/data/set.jsonl", str(target)) == str(target)
    assert target.read_bytes() == FILE
    assert download_and_cache_file(url + "/data/set.jsonl", str(target)) == str(target)
    assert Handler.hits["/data/set.jsonl"] == before + 1  # the second call did not fetch it again
    assert not list(tmp_path.glob("*.part*"))
    # a failed download leaves nothing behind that a later call would take for the file
    with pytest.raises(urllib.error.HTTPError):
        download_and_cache_file(url + "/data/missing.jsonl", str(tmp_path / "missing.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set.jsonl"]
    with pytest.raises(ValueError, match="names no file"):
        download_and_cache_file(url + "/")

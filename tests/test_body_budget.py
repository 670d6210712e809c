"""Request bodies in flight share one byte budget (``http_api.BodyBudget``).

One body is at most 64 MiB, but nothing bounded how many were read at once: many
clients sending large bodies together could exhaust the front's memory and take every
request down with it. Over the budget a body is a 503 with Retry-After; the bytes of
each body are given back once it is parsed, also when it fails.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from plait.errors import RequestError
from plait.runtime.server import http_api


class FakeRequest:
    """What read_json reads: headers and a body stream, held open at ``hold`` until
    ``release`` is set."""

    def __init__(self, parts: list[bytes], hold: int | None = None) -> None:
        self.headers: dict[str, str] = {}
        self.parts, self.hold = parts, hold
        self.release = asyncio.Event()
        self.held = asyncio.Event()

    async def stream(self) -> Any:
        for i, part in enumerate(self.parts):
            if i == self.hold:
                self.held.set()
                await self.release.wait()
            yield part


def test_bodies_past_the_budget_are_a_503_and_their_bytes_come_back():
    async def main() -> None:
        budget = http_api.BodyBudget(1000)
        slow = FakeRequest([b'{"a": "' + b"x" * 600, b'"}'], hold=1)  # 607 bytes read, then waits
        task = asyncio.ensure_future(http_api.read_json(slow, budget))
        await slow.held.wait()
        assert budget.used == 607
        with pytest.raises(RequestError) as e:
            await http_api.read_json(FakeRequest([b'{"b": "' + b"y" * 500 + b'"}']), budget)
        assert e.value.status == 503 and "at most 1000" in str(e.value)
        assert budget.used == 607  # the refused body gave back what it had taken
        small, _ = await http_api.read_json(FakeRequest([b'{"c": 1}']), budget)  # fits beside it
        assert small == {"c": 1}
        slow.release.set()
        obj, size = await task
        assert obj == {"a": "x" * 600} and size == 609
        assert budget.used == 0
        with pytest.raises(RequestError):  # malformed: a 400, and its bytes still come back
            await http_api.read_json(FakeRequest([b'{"d": ']), budget)
        assert budget.used == 0
        again, _ = await http_api.read_json(FakeRequest([b'{"b": "' + b"y" * 500 + b'"}']), budget)
        assert again == {"b": "y" * 500}

    asyncio.run(main())


def test_a_503_over_the_budget_reaches_the_client_with_retry_after(monkeypatch):
    from starlette.testclient import TestClient

    monkeypatch.setattr(http_api, "MAX_BODIES_BYTES", 100)
    app = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key=None)))  # refused before any parse
    body = json.dumps({"model": "m", "prompt": "x" * 200}).encode()
    with TestClient(app) as client:
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert "at most 100 are read at once" in r.json()["error"]["message"]

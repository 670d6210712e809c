"""Short bodies that carry schemas are parsed off the event loop.

A chat body with ``tools`` has every ``parameters`` schema checked against its
metaschema, and a forced call (``tool_choice`` "required" or a named function) has
the schemas translated to one regex: ~60 ms for a 17 KB enum-heavy schema, and a body
under the 16 KB "long text" threshold was parsed on the front's event loop, stalling
every stream for that long. A response schema under a reasoning parser is translated
too. Such bodies now go to a worker thread whatever their size; plain short bodies
stay on the loop (a thread hop per request buys nothing there).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from plait.errors import RequestError

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _post(monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any]) -> bool:
    """Whether the route's parse ran on the event loop for ``body``."""
    from starlette.testclient import TestClient

    from plait.runtime.server import http_api
    from plait.runtime.server import openai_api as oa
    from plait.runtime.server import responses_api as ra

    seen: list[bool] = []

    def parse(*args: Any) -> Any:
        seen.append(_on_loop())
        raise RequestError("parsed", None)

    monkeypatch.setattr(oa, "parse_chat", parse)
    monkeypatch.setattr(oa, "parse_completion", parse)
    monkeypatch.setattr(ra, "parse_response_request", parse)
    app = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key=None)))  # parse is all the route reaches
    with TestClient(app) as client:
        r = client.post(route, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "parsed" in r.text
    assert len(seen) == 1
    return seen[0]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra", [
    {"tools": TOOLS},
    {"tools": TOOLS, "tool_choice": "required"},
    {"response_format": SCHEMA},
])
def test_a_short_chat_with_a_schema_is_parsed_off_the_loop(monkeypatch, extra):
    assert not _post(monkeypatch, "/v1/chat/completions", {**CHAT, **extra})


def test_a_short_responses_body_with_tools_or_a_format_is_parsed_off_the_loop(monkeypatch):
    assert not _post(monkeypatch, "/v1/responses", {"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    assert not _post(monkeypatch, "/v1/responses", {"model": "m", "input": "hi", "text": {
        "format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})


def test_a_short_plain_body_stays_on_the_loop(monkeypatch):
    assert _post(monkeypatch, "/v1/chat/completions", CHAT)
    assert _post(monkeypatch, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert _post(monkeypatch, "/v1/responses", {"model": "m", "input": "hi"})

"""Helpers the HTTP server tests share."""

from __future__ import annotations

import time
from typing import Any

import httpx


def wait_idle(http: httpx.Client) -> dict[str, Any]:
    """Server info once nothing runs (bounded wait)."""
    for _ in range(400):
        info = http.get("/server_info").json()
        if info["running"] == 0 and info["waiting"] == 0 and info["in_flight"] == 0 and info["live_requests"] == 0:
            return info
        time.sleep(0.025)
    raise AssertionError(f"server did not become idle: {info}")

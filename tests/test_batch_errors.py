"""A refused prompt in a batch is named by its position.

``/v1/completions`` with a list of prompts and ``/generate`` with a list of texts or
token-id lists submit one engine request per prompt; when one is refused (too long for
the context, a token id out of the vocabulary...) the 400 said what was wrong but not
with which of the prompts, so a client with a batch of thousands could not find it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.server.http_api import Submission


class FakeFront:
    """Refuses the request whose rid is ``bad``; records what was aborted."""

    def __init__(self, bad: str, status: int = 400) -> None:
        self.bad, self.status = bad, status
        self.aborted: list[str] = []

    async def submit(self, req: P.GenerateRequest, sink: Any, prompt_param: str | None = None) -> Any:
        if req.rid == self.bad:
            raise RequestError("the prompt has 5000 tokens; the context holds 1024", prompt_param or "text",
                               self.status)
        return SimpleNamespace(rid=req.rid, n=1, done=[])

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True


def _reqs(n: int, text: bool = True) -> list[P.GenerateRequest]:
    return [P.GenerateRequest(rid=f"r{i}", text="x" if text else None, input_ids=None if text else [1])
            for i in range(n)]


def _refusal(front: FakeFront, reqs: list[P.GenerateRequest], param: str | None) -> RequestError:
    with pytest.raises(RequestError) as e:
        asyncio.run(Submission(front).submit(reqs, param))  # type: ignore[arg-type]
    return e.value


def test_a_refused_prompt_in_a_batch_is_named_by_its_position():
    front = FakeFront("r2")
    e = _refusal(front, _reqs(4), "prompt")
    assert e.message == "prompt[2] (of 4): the prompt has 5000 tokens; the context holds 1024"
    assert e.param == "prompt" and e.status == 400
    assert front.aborted == ["r0", "r1"]  # all or none: those before it are aborted
    e = _refusal(FakeFront("r1"), _reqs(3, text=False), None)  # /generate names its own field
    assert e.message.startswith("input_ids[1] (of 3): ")
    e = _refusal(FakeFront("r0"), _reqs(2), None)
    assert e.message.startswith("text[0] (of 2): ")


def test_a_single_prompt_and_a_server_error_keep_their_message():
    assert _refusal(FakeFront("r0"), _reqs(1), "prompt").message.startswith("the prompt has")
    e = _refusal(FakeFront("r1", status=503), _reqs(3), "prompt")
    assert e.status == 503 and e.message.startswith("the prompt has")

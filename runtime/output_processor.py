"""One output path: after each step, the requests that changed become typed outputs.

:class:`OutputProcessor` owns everything a request's output needs beyond its tokens:
detokenized text, stop-string and stop_regex matching (it ends a request whose stop string appears,
through :meth:`Scheduler.finish`), what has been reported so far, and the final result.
:meth:`Engine.step` hands it the requests that changed in that step and returns its
:class:`RequestOutput` list; the server's engine loop and the language's in-process
backend both consume those, and nothing else turns requests into outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.detokenizer import IncrementalDetokenizer, TextState, match_stop, match_stop_regex, safe_text_len
from plait.runtime.request import FinishReason, Req
from plait.runtime.scheduler import Scheduler
from plait.runtime.stop_regex import StopRegexScan, compile_stop_regex


@dataclass
class _Cursor:
    """One sequence's output state: its text and what has been reported."""

    text: TextState
    regex: StopRegexScan | None = None  # the search for stop_regex over ``text``
    sent_text: int = 0
    sent_ids: int = 0
    sent_logprobs: int = 0
    sent_input_logprobs: bool = False
    first_token_time: float | None = None


@dataclass
class RequestOutput:
    """What one sequence produced since its previous output. ``text`` and
    ``token_ids`` are new (the streamed pieces concatenate to the final text; text
    that may still turn into a stop string is held back); ``meta`` has
    ``completion_tokens`` and the new logprob entries. When the sequence finished,
    ``finish_reason`` is set and ``result`` is the whole output (``text``,
    ``output_ids``, ``meta_info``), unless it failed as a client error: then
    ``error`` is set instead."""

    rid: str  # the engine's id of this sequence
    group: str  # the client's rid (all n copies share it)
    index: int
    text: str
    token_ids: list[int]
    meta: dict[str, Any]
    finish_reason: FinishReason | None = None
    result: dict[str, Any] | None = None
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def chunk(self) -> P.StreamChunk | None:
        """This output as a stream message, or None when it carries nothing new."""
        if not self.text and not self.token_ids:
            return None
        return P.StreamChunk(self.group, self.index, self.text, self.token_ids, self.meta)


@dataclass
class OutputProcessor:
    tokenizer: Any
    scheduler: Scheduler
    detokenizer: IncrementalDetokenizer = field(init=False)
    _cursors: dict[str, _Cursor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)

    def start(self, r: Req, skip: int = 0) -> None:
        """Track ``r`` (again, with ``skip`` characters of healed prompt text, when token
        healing changed its prompt before the output began)."""
        old = self._cursors.get(r.rid)
        patterns = r.params.stop_regex  # checked where the request entered; the compile is cached
        scan = compile_stop_regex(tuple(patterns)).scanner() if patterns else None
        cur = _Cursor(self.detokenizer.start(r, skip), scan)
        if old is not None:
            cur.first_token_time = old.first_token_time
        self._cursors[r.rid] = cur

    def forget(self, r: Req) -> None:
        self._cursors.pop(r.rid, None)

    def process(self, reqs: Iterable[Req]) -> list[RequestOutput]:
        """Outputs of the requests that changed this step (new tokens, or finished)."""
        now = time.monotonic()
        outs = []
        for r in reqs:
            cur = self._cursors.get(r.rid)
            if cur is None:
                continue
            if cur.first_token_time is None and r.output_len > 0:
                cur.first_token_time = now
            out = self._output(r, cur)
            if out is not None:
                outs.append(out)
            if r.finished:
                del self._cursors[r.rid]
        return outs

    def _output(self, r: Req, cur: _Cursor) -> RequestOutput | None:
        st, stops = cur.text, r.params.stop
        reason = r.finish_reason
        ended_by_token = reason is not None and reason.by_token
        if stops or cur.regex is not None:
            # token by token, as steps of one token would see them: a step may append
            # several (verified drafts, jump-forward), and the output ends at the one
            # that completes a stop string or a stop_regex match (before an ending EOS /
            # stop id); a stop string found in the same token wins, as in SGLang
            for end in range(st.read + 1, r.seq_len if ended_by_token else r.seq_len + 1):
                piece = self.detokenizer.step(r, st, end)
                matched = match_stop(st, stops, piece, r.params.no_stop_trim)
                if matched is None and cur.regex is not None and piece:
                    matched = match_stop_regex(st, cur.regex, piece, r.params.no_stop_trim)
                if matched is not None:
                    self.scheduler.finish(r, FinishReason.stop(matched), keep=end)
                    reason = r.finish_reason
                    break
        elif r.token_ids and st.read < r.seq_len and not ended_by_token:
            self.detokenizer.step(r, st)
        if reason is not None and not (reason.type == "stop" and isinstance(reason.matched, str)):
            # the EOS / stop id that ended the output stays in output_ids and out of the
            # text (SGLang trims it, vLLM too): with skip_special_tokens=false its text
            # ('<|im_end|>', '</s>') would end every reply; no_stop_trim keeps it
            trim = ended_by_token and not r.params.no_stop_trim
            self.detokenizer.flush(r, st, r.seq_len - 1 if trim else None)
        if reason is not None and reason.error is not None:
            return RequestOutput(r.rid, r.group, r.index, "", [], {}, reason, error=reason.error)

        text = st.text
        if reason is not None:
            end = len(text)
        else:  # what may still be trimmed (the start of a stop string, a match in progress) waits
            held = min(safe_text_len(text, stops), len(text) if cur.regex is None else cur.regex.held_from)
            end = max(held, cur.sent_text)
        piece, ids = text[cur.sent_text : end], r.token_ids[r.prompt_len + cur.sent_ids :]
        if reason is None and not piece and not ids:
            return None
        # each piece carries SGLang's per-chunk meta info (programs read finish_reason or
        # prompt_tokens on every piece); the final result has them all again
        meta: dict[str, Any] = {"id": r.rid, "prompt_tokens": r.prompt_len + r.healed,
                                "completion_tokens": r.completion_len, "cached_tokens": r.cached_tokens,
                                "finish_reason": None if reason is None else reason.to_dict()}
        lp = r.logprobs
        if lp is not None:
            meta["output_token_logprobs"] = lp.output_token[cur.sent_logprobs :]
            if lp.top_n > 0:
                meta["output_top_logprobs"] = lp.output_top[cur.sent_logprobs :]
            cur.sent_logprobs = len(lp.output_token)
            if not cur.sent_input_logprobs:  # the prompt's, complete once anything is output: in the first
                meta["input_token_logprobs"] = lp.input_token
                if lp.top_n > 0:
                    meta["input_top_logprobs"] = lp.input_top
                cur.sent_input_logprobs = True
        cur.sent_text, cur.sent_ids = end, r.output_len
        out = RequestOutput(r.rid, r.group, r.index, piece, ids, meta, reason)
        if reason is not None:
            out.result = self._result(r, cur, reason)
        return out

    def _result(self, r: Req, cur: _Cursor, reason: FinishReason) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid,
            "prompt_tokens": r.prompt_len + r.healed,  # the prompt as sent (Req.completion_len)
            "completion_tokens": r.completion_len,
            "cached_tokens": r.cached_tokens,
            "finish_reason": reason.to_dict(),
            "first_token_time": cur.first_token_time,
        }
        lp = r.logprobs
        if lp is not None:
            meta["output_token_logprobs"] = lp.output_token
            meta["input_token_logprobs"] = lp.input_token
            if lp.top_n > 0:
                meta["output_top_logprobs"] = lp.output_top
                meta["input_top_logprobs"] = lp.input_top
        return {"text": cur.text.text, "output_ids": r.output_ids, "meta_info": meta}

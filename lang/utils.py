"""SGLang's ``sglang.utils`` helpers that programs and scripts import next to the
language: reading a data file, writing program states out, and merging the text of an
offline engine's stream (``from sglang.utils import dump_state_text`` becomes ``from
plait.utils import dump_state_text``).

Light like the rest of the language: nothing here imports torch.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterable
from typing import Any

__all__ = ["read_jsonl", "dump_state_text", "trim_overlap", "stream_and_merge", "async_stream_and_merge",
           "print_highlight", "wait_for_server"]


def read_jsonl(filename: str) -> list[Any]:
    """The JSON value of each line of ``filename``, as a list (SGLang's benchmarks
    slice it: ``read_jsonl(path)[:n]``). Lines starting with ``#`` and blank lines are
    skipped."""
    out: list[Any] = []
    with open(filename, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.startswith("#") or not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{filename}:{number} is not a JSON value: {e}") from e
    return out


def dump_state_text(filename: str, states: Iterable[Any], mode: str = "w") -> None:
    """Write each state's text (a program state's ``text()``, a string as it is,
    anything else as ``str``) to ``filename``, each under a rule with its index, in
    the layout SGLang's benchmarks write their outputs in."""
    from plait.interpreter import ProgramState

    with open(filename, mode, encoding="utf-8") as f:
        for i, state in enumerate(states):
            if isinstance(state, ProgramState):
                text = state.text()
            else:
                text = state if isinstance(state, str) else str(state)
            f.write(f"{'=' * 40} {i} {'=' * 40}\n{text}\n{'=' * 80}\n\n")


def trim_overlap(existing_text: str, new_chunk: str) -> str:
    """``new_chunk`` without its longest start that is also an end of
    ``existing_text``: what a streamed chunk adds to the text merged so far."""
    for size in range(min(len(existing_text), len(new_chunk)), 0, -1):
        if existing_text.endswith(new_chunk[:size]):
            return new_chunk[size:]
    return new_chunk


def stream_and_merge(llm: Any, prompt: str, sampling_params: dict[str, Any] | None = None) -> str:
    """Stream one generation of an offline engine (``llm.generate(prompt, params,
    stream=True)``) and return its text, merged from the chunks."""
    merged = ""
    for chunk in llm.generate(prompt, sampling_params, stream=True):
        merged += trim_overlap(merged, chunk["text"])
    return merged


async def async_stream_and_merge(llm: Any, prompt: str,
                                 sampling_params: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """``stream_and_merge`` for asyncio: yields what each chunk adds, as it comes."""
    merged = ""
    async for chunk in await llm.async_generate(prompt, sampling_params, stream=True):
        piece = trim_overlap(merged, chunk["text"])
        merged += piece
        yield piece


def print_highlight(content: Any) -> None:
    """Print ``content`` (SGLang's docs helper; it highlights only in its notebooks)."""
    print(content)


def wait_for_server(base_url: str, timeout: float | None = None, process: Any = None) -> None:
    """Wait until the server at ``base_url`` (``http://host:port``, as ``plait serve``
    prints it) answers its health probe. ``timeout`` (seconds; None waits for ever)
    raises ``TimeoutError``; ``process`` (the server's ``subprocess.Popen``) raises
    ``RuntimeError`` as soon as it has exited, instead of waiting for nothing."""
    url = base_url.rstrip("/") + "/health"
    start = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server process exited with code {process.returncode} before {base_url} "
                               "answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if timeout is not None and time.monotonic() - start > timeout:
            raise TimeoutError(f"{base_url} did not answer {url} within {timeout} s")
        time.sleep(0.2)

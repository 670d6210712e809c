"""SGLang's ``sglang.utils`` helpers that programs and scripts import next to the
language: reading a data file, writing program states out, merging the text of an
offline engine's stream, and starting / waiting for / stopping a server from a script
the way SGLang's docs do (``from sglang.utils import dump_state_text`` becomes ``from
plait.utils import dump_state_text``).

Light like the rest of the language: nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterable
from typing import Any

__all__ = ["read_jsonl", "dump_state_text", "trim_overlap", "stream_and_merge", "async_stream_and_merge",
           "print_highlight", "wait_for_server", "launch_server_cmd", "terminate_process", "execute_shell_command",
           "http_request", "HttpResponse", "download_and_cache_file", "normalize_base_url"]


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


def normalize_base_url(host: str, port: int | str | None = None) -> str:
    """The server URL for ``host`` (and ``port``), as SGLang's benchmark scripts build
    it from ``--host`` / ``--port``: ``http://`` added when there is no scheme, trailing
    slashes dropped, ``:port`` added unless the host names one already
    (``normalize_base_url("http://127.0.0.1", 30000)`` is ``http://127.0.0.1:30000``)."""
    url = str(host).strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if port is not None and str(port).strip():
        parts = urllib.parse.urlsplit(url)
        try:
            has_port = parts.port is not None
        except ValueError as e:
            raise ValueError(f"host={host!r} has an invalid port: {e}") from None
        if not has_port:
            netloc = parts.netloc + f":{int(port)}"
            url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


def print_highlight(content: Any) -> None:
    """Print ``content`` (SGLang's docs helper; it highlights only in its notebooks)."""
    print(content)


def wait_for_server(base_url: str, timeout: float | None = None, process: Any = None) -> None:
    """Wait until the server at ``base_url`` (``http://host:port``, as ``plait serve``
    prints it) answers its health probe. ``timeout`` (seconds; None waits for ever)
    raises ``TimeoutError``; ``process`` (the server's ``subprocess.Popen``) raises
    ``RuntimeError`` as soon as it has exited, instead of waiting for nothing."""
    url = base_url.rstrip("/") + "/health"
    if process is None:  # a server launch_server_cmd started on this port: notice if it dies
        process = _launched.get(urllib.parse.urlsplit(url).port or -1)
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


# servers started by launch_server_cmd, by port: wait_for_server(url) without a process
# still stops waiting when the server it waits for has exited (a bad flag, a missing model)
_launched: dict[int, subprocess.Popen] = {}

# launchers of SGLang, vLLM and plait: the options after them go to plait's server, which
# takes SGLang's and vLLM's option names (docs/serving.md)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?$")
_MODULES = {"sglang.launch_server", "plait.runtime.server", "vllm.entrypoints.openai.api_server"}
_SERVE = {"sglang", "vllm", "plait"}


def _split(command: str | list[str]) -> list[str]:
    if not isinstance(command, str):
        return [str(part) for part in command]
    return shlex.split(command.replace("\\\n", " "))  # shell line continuations, as in the docs


def _server_argv(parts: list[str]) -> list[str]:
    """``parts`` with an SGLang / vLLM / plait launcher replaced by plait's server in this
    interpreter; any other command unchanged."""
    head = [os.path.basename(p) for p in parts[:3]]
    if len(parts) >= 3 and _PYTHON.match(head[0]) and parts[1] == "-m" and parts[2] in _MODULES:
        rest = parts[3:]
    elif len(parts) >= 2 and head[0] in _SERVE and parts[1] == "serve":
        rest = parts[2:]
    else:
        return parts
    return [sys.executable, "-m", "plait.runtime.server", *rest]


def _port_option(parts: list[str]) -> int | None:
    for i, part in enumerate(parts):
        value = part.split("=", 1)[1] if part.startswith("--port=") else (
            parts[i + 1] if part == "--port" and i + 1 < len(parts) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"--port {value!r} is not a port number") from None
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("" if host in ("0.0.0.0", "") else host, 0))
        return s.getsockname()[1]


def execute_shell_command(command: str | list[str]) -> subprocess.Popen:
    """Start ``command`` (a string split as a shell would, line continuations allowed, or
    an argument list; no shell runs it) in a process group of its own and return it;
    :func:`terminate_process` stops the group."""
    parts = _split(command)
    if not parts:
        raise ValueError("execute_shell_command: the command is empty")
    return subprocess.Popen(parts, start_new_session=True)


def launch_server_cmd(command: str | list[str], host: str = "0.0.0.0", port: int | None = None
                      ) -> tuple[subprocess.Popen, int]:
    """Start a server from its command line, as SGLang's docs do, and return ``(process,
    port)`` at once (:func:`wait_for_server` waits until it answers). An SGLang, vLLM or
    plait launch command (``python -m sglang.launch_server --model-path M ...``, ``vllm
    serve M ...``, ``plait serve M ...``) runs plait's server with the same options;
    another command runs as given. ``port``: the HTTP port, else the command's own
    ``--port``, else a free one on ``host`` (appended as ``--port``)."""
    parts = _server_argv(_split(command))
    if not parts:
        raise ValueError("launch_server_cmd: the command is empty")
    own = _port_option(parts)
    if port is None:
        port = own if own is not None else _free_port(host)
    if own != port:
        parts = [*parts, "--port", str(port)]
    process = execute_shell_command(parts)
    _launched[port] = process
    return process, port


def terminate_process(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a process started by :func:`launch_server_cmd` (or
    :func:`execute_shell_command`) with everything it started (a server's engine
    process): SIGTERM to its process group, SIGKILL after ``timeout`` seconds."""
    for port, p in list(_launched.items()):
        if p is process:
            del _launched[port]
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)  # its own group (start_new_session)
    except (ProcessLookupError, PermissionError, AttributeError):
        process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, AttributeError):
            process.kill()
        process.wait()


# -- HTTP helpers SGLang's scripts import (sglang.utils.http_request, download_and_cache_file) --
class HttpResponse:
    """A reply of :func:`http_request`, read the way SGLang's scripts read one (the
    parts of ``requests.Response`` they use): ``status_code``, ``headers``, ``json()``,
    ``text``, ``content``; a streamed one also ``iter_lines()`` / ``iter_content()``,
    which read the body as it arrives. An HTTP error status is a reply too, not an
    exception (``raise_for_status()`` raises it)."""

    def __init__(self, resp: Any, url: str) -> None:
        self._resp = resp
        self.url = url
        self.status_code: int = getattr(resp, "status", None) or resp.getcode()
        self.headers = resp.headers
        self._body: bytes | None = None

    @property
    def content(self) -> bytes:
        if self._body is None:
            try:
                self._body = self._resp.read()
            finally:
                self._resp.close()
        return self._body

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.status_code < 400

    def json(self) -> Any:
        return json.loads(self.content)

    def iter_content(self, chunk_size: int | None = 1, decode_unicode: bool = False) -> Iterable[Any]:
        """The body in pieces of up to ``chunk_size`` bytes as they arrive (None: what
        each read returns)."""
        if self._body is not None:
            pieces: Iterable[bytes] = [self._body]
        else:
            pieces = self._reads(chunk_size or 65536, whole=chunk_size is not None)
        if not decode_unicode:
            yield from pieces
            return
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for piece in pieces:
            text = decoder.decode(piece)
            if text:
                yield text
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    def _reads(self, size: int, whole: bool) -> Iterable[bytes]:
        try:
            while True:
                piece = self._resp.read(size) if whole else getattr(self._resp, "read1", self._resp.read)(size)
                if not piece:
                    return
                yield piece
        finally:
            self._resp.close()

    def iter_lines(self, chunk_size: int = 512, decode_unicode: bool = False,
                   delimiter: bytes | str | None = None) -> Iterable[Any]:
        """The body's lines as they arrive, without their line ends (SGLang's
        streaming scripts read ``data: ...`` events this way); bytes unless
        ``decode_unicode``."""
        sep = (delimiter.encode() if isinstance(delimiter, str) else delimiter) or b"\n"
        pending = b""
        for piece in self.iter_content(None):
            *lines, pending = (pending + piece).split(sep)
            for line in lines:
                line = line if delimiter else line.rstrip(b"\r")
                yield line.decode("utf-8", errors="replace") if decode_unicode else line
        if pending:
            yield pending.decode("utf-8", errors="replace") if decode_unicode else pending

    def raise_for_status(self) -> None:
        if not self.ok:
            raise urllib.error.HTTPError(self.url, self.status_code, self.text[:500], self.headers, None)

    def close(self) -> None:
        self._resp.close()

    def __enter__(self) -> HttpResponse:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HttpResponse [{self.status_code}]>"


def _ssl_context(url: str, verify: Any) -> Any:
    if not url.lower().startswith("https:"):
        return None
    import ssl

    if verify is False:
        return ssl._create_unverified_context()  # noqa: S323 - asked for by the caller
    return ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)


def http_request(url: str, json: Any = None, stream: bool = False, api_key: str | None = None,
                 verify: Any = None, method: str | None = None, timeout: float | None = None) -> HttpResponse:
    """Send ``json`` (any JSON value; None: no body) to ``url`` and return the reply
    (:class:`HttpResponse`), as SGLang's ``sglang.utils.http_request``: a POST when
    there is a body (or ``stream``), else a GET, unless ``method`` says otherwise;
    ``api_key`` as a Bearer token; ``verify`` a CA file, or False for an HTTPS server's
    unchecked certificate; ``stream``: the body is read as it arrives (``iter_lines``).
    An HTTP error status is returned, not raised."""
    import json as _json

    headers = {"Content-Type": "application/json; charset=utf-8"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if json is None else _json.dumps(json).encode("utf-8")
    if method is None and stream:
        method = "POST"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        resp = urllib.request.urlopen(request, timeout=timeout, context=_ssl_context(url, verify))
    except urllib.error.HTTPError as e:  # a reply with an error status: the caller reads it
        resp = e
    return HttpResponse(resp, url)


def download_and_cache_file(url: str, filename: str | None = None) -> str:
    """The path of ``url``'s content on disk, downloaded once: ``filename``, else the
    URL's last segment in the temporary directory (SGLang's benchmarks fetch their
    datasets this way). An existing file is taken as it is; a download goes to a
    temporary name first, so an interrupted one is not mistaken for the file later."""
    import tempfile

    import tqdm

    if filename is None:
        name = urllib.parse.urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]
        if not name:
            raise ValueError(f"download_and_cache_file: {url!r} names no file; pass filename")
        filename = os.path.join(tempfile.gettempdir(), name)
    if os.path.exists(filename):
        return filename
    print(f"Downloading from {url} to {filename}")
    partial = f"{filename}.part{os.getpid()}"
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(partial, "wb") as f, tqdm.tqdm(
                desc=os.path.basename(filename), total=int(resp.headers.get("Content-Length") or 0) or None,
                unit="B", unit_scale=True, unit_divisor=1024) as bar:
            while piece := resp.read(1 << 16):
                f.write(piece)
                bar.update(len(piece))
        os.replace(partial, filename)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return filename

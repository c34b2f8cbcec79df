"""The one owner of a connection to a model server: JSON requests and streamed (server-sent events) completions.

Every failure becomes a BackendError that names the server and says what went wrong (not reachable, no answer
within the timeout, an HTTP error with the server's message, malformed data), never a raw socket traceback.
A stream is read by its own thread into a queue, so the caller can watch its cancel flag between events and
close the stream at once (closing the connection is how a client stops llama.cpp's and vLLM's generation).
Standard library only.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

from app.backends.base import BackendError

MAX_LINE = 1 << 20  # one server-sent event's line; a longer one is malformed data
MAX_ERROR_BODY = 1 << 16
POLL_S = 0.05  # how often a waiting stream looks at its cancel flag


class ServerHTTPError(BackendError):
    """The server answered with an HTTP error status (kept, so kind detection can tell 404 from down)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ModelServer:
    """A model server's base URL, timeout and API key. Stateless between requests (each opens its own
    connection), so one instance serves every session and thread."""

    def __init__(self, url: str, timeout_s: float = 60.0, api_key: str | None = None):
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BackendError(f"MODEL_SERVER_URL must look like http://127.0.0.1:8080, not {url!r}")
        if not timeout_s > 0:
            raise BackendError(f"the model server timeout must be positive, not {timeout_s}")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._https = parts.scheme == "https"
        self._host, self._port, self._base = parts.hostname, parts.port, parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._api_key = api_key

    def __repr__(self) -> str:
        return f"ModelServer({self.url!r})"

    def get_json(self, path: str) -> dict:
        return self._request("GET", path, None)

    def post_json(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def stream(self, path: str, body: dict) -> "EventStream":
        """POST `body` and return its stream of server-sent events (use it as a context manager)."""
        conn = self._connect()
        try:
            response = self._send(conn, "POST", path, body)
            return EventStream(self, conn, response)
        except BaseException:
            conn.close()
            raise

    # ---- internals ------------------------------------------------------------------------------------------
    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=self.timeout_s)

    def _send(self, conn: http.client.HTTPConnection, method: str, path: str,
              body: dict | None) -> http.client.HTTPResponse:
        headers = {"Accept": "application/json, text/event-stream"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode()
        with self.errors(path):
            conn.request(method, self._base + path, body=data, headers=headers)
            response = conn.getresponse()
            if response.status >= 400:
                raise ServerHTTPError(f"model server {self.url} answered {path} with HTTP {response.status}: "
                                      f"{error_message(response.read(MAX_ERROR_BODY))}", response.status)
        return response

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        conn = self._connect()
        try:
            response = self._send(conn, method, path, body)
            with self.errors(path):
                return parse_json(response.read(), self, path)
        finally:
            conn.close()

    def errors(self, path: str) -> "_Errors":
        """A context that turns network and protocol failures into BackendErrors about this server."""
        return _Errors(self, path)


class _Errors:
    def __init__(self, server: ModelServer, path: str):
        self.server, self.path = server, path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, BackendError):
            return False
        where = f"model server {self.server.url}"
        if isinstance(error, (socket.timeout, TimeoutError)):
            raise BackendError(f"{where} did not answer {self.path} within {self.server.timeout_s:g} s") from None
        if isinstance(error, ConnectionRefusedError):
            raise BackendError(f"{where} is not reachable: connection refused") from None
        if isinstance(error, (http.client.HTTPException, ConnectionError)):
            raise BackendError(f"{where} closed the connection during {self.path} "
                               f"({type(error).__name__}: {error})") from None
        if isinstance(error, OSError):
            raise BackendError(f"{where} is not reachable: {error.strerror or error}") from None
        return False


def parse_json(data: bytes, server: ModelServer, path: str):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BackendError(f"model server {server.url} sent malformed data for {path}: {error} "
                           f"({data[:80]!r})") from None


def error_message(body: bytes) -> str:
    """The message of an error body: `{"error": {"message": ...}}` (llama.cpp, vLLM), `{"error": "..."}`,
    `{"message": ...}` or `{"detail": ...}`; else the start of the raw body."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return body[:200].decode("utf-8", "replace").strip() or "(no message)"
    if isinstance(value, dict):
        for key in ("error", "message", "detail"):
            if key in value:
                inner = value[key]
                return str(inner.get("message", inner) if isinstance(inner, dict) else inner)[:500]
    return str(value)[:500]


_END = object()


class EventStream:
    """The JSON events of one streamed response, read by a daemon thread. `events(cancel)` yields them and
    returns early when `cancel` is set; `close()` (or leaving the `with`) closes the connection."""

    def __init__(self, server: ModelServer, conn: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self._server, self._conn, self._response = server, conn, response
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="model-server-stream", daemon=True)
        self._reader.start()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def events(self, cancel: threading.Event | None = None) -> Iterator[dict]:
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    return
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if cancel is not None and cancel.is_set():
                return

    def close(self) -> None:
        """Close the connection: the server sees the client go and stops generating; the reader thread ends."""
        if self._closed.is_set():
            return
        self._closed.set()
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by the other side
                pass
        self._conn.close()
        self._reader.join(timeout=5)

    def _read(self) -> None:
        path = "the completion stream"
        try:
            with self._server.errors(path):
                while not self._closed.is_set():
                    line = self._response.readline(MAX_LINE + 1)
                    if not line:
                        break
                    if len(line) > MAX_LINE:
                        raise BackendError(f"model server {self._server.url} sent an event longer than "
                                           f"{MAX_LINE} bytes")
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, `event:` and `:` comment lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = parse_json(data, self._server, path)
                    if not isinstance(event, dict):
                        raise BackendError(f"model server {self._server.url} sent an event that is not a JSON "
                                           f"object: {data[:80]!r}")
                    self._queue.put(event)
            self._queue.put(_END)
        except Exception as error:  # the thread's boundary: every failure reaches the consumer, which raises it
            if self._closed.is_set():  # we closed it (Stop): whatever the dying connection raised means nothing
                self._queue.put(_END)
            elif isinstance(error, BackendError):
                self._queue.put(error)
            else:  # e.g. http.client failing to parse a chunk cut off by a crashed server (ValueError)
                self._queue.put(BackendError(f"model server {self._server.url} broke off the completion stream "
                                             f"({type(error).__name__}: {error})"))

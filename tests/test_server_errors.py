"""A model server that is silent, stalls, errs or sends malformed data: each is a clear BackendError and the
session is rolled back to where it was. The peers are tiny real HTTP servers on loopback that misbehave on
purpose (the working path is tested against llama.cpp's server in test_server_backend.py)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from app.backend import BackendError
from app.decoding import StopReason
from app.engine import Engine, Settings
from app.server_backend import LlamaCpp, ServerBackend
from app.server_client import ModelServer, error_message
from tests.http_peers import serve


def run_turn(url: str, tokenizer, timeout_s: float = 5.0):
    engine = Engine(ServerBackend(ModelServer(url, timeout_s=timeout_s), LlamaCpp(), tokenizer, 4096))
    session = engine.new_session(use_cache=False)  # no prompt warm-up request: the turn meets the misbehaviour
    before = list(session.cache.ids)
    with pytest.raises(BackendError) as caught:
        engine.ask(session, "What is 41 * 23?", Settings(max_new_tokens=8))
    segment = session.episodes[-1].segments[-1]
    assert segment.stop.reason is StopReason.ERROR and segment.start == segment.end == len(session.cache)
    assert session.cache.ids[:len(before)] == before
    return str(caught.value)


def test_malformed_event(server_tokenizer):
    httpd, url = serve(b"data: {not json\n\n")
    with httpd:
        assert run_turn(url, server_tokenizer).startswith(f"model server {url} sent malformed data")
        httpd.shutdown()


def test_event_without_the_fields_of_the_route(server_tokenizer):
    httpd, url = serve(b'data: {"content": "hi"}\n\n')
    with httpd:
        assert "'tokens' is not a list" in run_turn(url, server_tokenizer)
        httpd.shutdown()


def test_token_ids_outside_the_vocabulary(server_tokenizer):
    event = {"content": "x", "tokens": [10**9], "stop": False, "tokens_predicted": 1}
    httpd, url = serve(f"data: {json.dumps(event)}\n\n".encode())
    with httpd:
        assert "outside the vocabulary" in run_turn(url, server_tokenizer)
        httpd.shutdown()


def test_http_error_with_the_servers_message(server_tokenizer):
    httpd, url = serve(b'{"error": {"code": 500, "message": "boom", "type": "server_error"}}', status=500)
    with httpd:
        assert run_turn(url, server_tokenizer) == f"model server {url} answered /completion with HTTP 500: boom"
        httpd.shutdown()


def test_stream_ending_before_the_completion_ends(server_tokenizer):
    event = {"content": "x", "tokens": [87], "stop": False, "tokens_predicted": 1}
    httpd, url = serve(f"data: {json.dumps(event)}\n\n".encode())
    with httpd:
        assert "ended the stream before the completion ended" in run_turn(url, server_tokenizer)
        httpd.shutdown()


def test_a_stalled_stream_times_out(server_tokenizer):
    event = {"content": "x", "tokens": [87], "stop": False, "tokens_predicted": 1}
    stalled = threading.Event()  # the peer holds the stream open, silent, until the client has given up
    httpd, url = serve(f"data: {json.dumps(event)}\n\n".encode(), hold=stalled)
    with httpd:
        try:
            message = run_turn(url, server_tokenizer, timeout_s=0.5)
        finally:
            stalled.set()
        assert message == f"model server {url} did not answer the completion stream within 0.5 s"
        httpd.shutdown()


def test_a_silent_server_times_out():
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(BackendError, match=r"did not answer /props within 0.3 s"):
            ModelServer(url, timeout_s=0.3).get_json("/props")


def test_bad_urls_and_error_bodies():
    with pytest.raises(BackendError, match="must look like"):
        ModelServer("127.0.0.1:8080")
    assert error_message(b'{"error": "bad prompt"}') == "bad prompt"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"<html>oops</html>") == "<html>oops</html>"

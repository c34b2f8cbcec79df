"""A model server that is silent, stalls, errs or sends malformed data: each is a clear BackendError and the
session is rolled back to where it was. The peers are tiny real HTTP servers on loopback that misbehave on
purpose (the working path is tested against llama.cpp's server in test_server_backend.py)."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace

import pytest

from app.backends.base import BackendError
from app.backends.server import LlamaCpp, ServerBackend
from app.backends.server_client import ModelServer, error_message
from app.decoding.stops import StopReason
from app.engine.engine import Engine
from app.episode import TextDelta
from app.episode import Provenance
from app.protocols.textenv.markers import SUBMIT
from app.protocols.base import encode
from app.settings import Settings
from tests.http_peers import llama_stream, serve


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


# ---- the guide's grammar (app.decoding.guide) -----------------------------------------------------------------------------
GRAMMAR_400 = (b'{"error": {"code": 400, "message": "Failed to initialize samplers: failed to parse grammar", '
               b'"type": "invalid_request_error"}}')  # llama.cpp's own answer (../shared/notes/stack-facts.md)
ONE_LINE = Settings(max_new_tokens=16, max_turns=0, guide=True)  # one guided segment: the answer line


def test_a_grammar_the_server_rejects_is_said_to_be_the_guides_and_the_next_turn_works(server_tokenizer):
    answer = llama_stream(server_tokenizer, "Result = 5", SUBMIT)
    requests = []
    httpd, url = serve(lambda body: (400, GRAMMAR_400) if "grammar" in body else (200, answer), requests=requests)
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), server_tokenizer, 4096))
        session = engine.new_session(use_cache=False)
        before = list(session.cache.ids)
        with pytest.raises(BackendError) as caught:
            engine.ask(session, "Hi!", ONE_LINE)
        assert str(caught.value) == (
            f"model server {url} rejected the guide's grammar (HTTP 400: Failed to initialize samplers: failed to "
            f"parse grammar): switch guided answers off (the page's Guided answers, `guide: false` in the API, "
            f"--no-guide in the CLI) to ask it without one")
        assert requests[-1]["grammar"] == engine.guide(ONE_LINE, None, None, calls=False).grammar
        failed = session.episodes[-1].segments[-1]
        assert failed.stop.reason is StopReason.ERROR and failed.start == failed.end == len(session.cache)
        assert session.cache.ids[:len(before)] == before
        episode = engine.ask(session, "Hi!", replace(ONE_LINE, guide=False))  # the same session goes on
        assert episode.answer == "Result = 5" and "grammar" not in requests[-1]
        httpd.shutdown()


def test_a_server_that_ignores_the_grammar_fails_the_segment_and_the_session_goes_on(server_tokenizer):
    """An answer that breaks the grammar came from a server that did not apply it (an older vLLM ignored unknown
    fields): not passed off as guided."""
    httpd, url = serve(llama_stream(server_tokenizer, "Hello there", SUBMIT))
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), server_tokenizer, 4096))
        session = engine.new_session(use_cache=False)
        before = list(session.cache.ids)
        with pytest.raises(BackendError, match=f"^the model server {url} did not apply the guide's grammar "):
            engine.ask(session, "Hi!", ONE_LINE)
        failed = session.episodes[-1].segments[-1]
        assert failed.stop.reason is StopReason.ERROR and failed.start == failed.end == len(session.cache)
        assert failed.generated_tokens == 0 and session.cache.ids[:len(before)] == before
        episode = engine.ask(session, "Hi!", replace(ONE_LINE, guide=False))
        assert episode.answer == "Hello there" and episode.segments[-1].provenance is None
        httpd.shutdown()


def test_a_guided_answer_from_the_server_records_who_chose_each_token(server_tokenizer):
    httpd, url = serve(llama_stream(server_tokenizer, "Result = 5", SUBMIT))
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), server_tokenizer, 4096))
        segment = engine.ask(engine.new_session(use_cache=False), "Hi!", ONE_LINE).segments[-1]
        httpd.shutdown()
    ids = encode(server_tokenizer, "Result = 5" + SUBMIT)
    assert segment.end - segment.start == len(ids) == len(segment.provenance)
    # "Result =" is the only reply the grammar allows without tools; then the model chose
    prefix = len(encode(server_tokenizer, "Result ="))
    assert segment.provenance[:prefix] == [Provenance.FORCED] * prefix
    assert Provenance.MODEL in segment.provenance[prefix:] and Provenance.STEERED not in segment.provenance
    assert segment.steered_tokens is None and segment.generated_tokens == len(ids) - segment.forced_tokens


def test_a_guided_segment_closed_mid_stream_keeps_the_provenance_of_its_tokens(server_tokenizer):
    """The page's Stop closes the turn (and the segment's stream) between two events: the tokens kept still say
    who chose them."""
    ids = encode(server_tokenizer, "Result = 5")
    event = {"content": "Result = 5", "tokens": ids, "stop": False, "tokens_predicted": len(ids)}
    stalled = threading.Event()
    httpd, url = serve(f"data: {json.dumps(event)}\n\n".encode(), hold=stalled)
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), server_tokenizer, 4096))
        session = engine.new_session(use_cache=False)
        turn = engine.turn(session, "Hi!", ONE_LINE)
        try:
            for item in turn:
                if isinstance(item, TextDelta):
                    turn.close()
        finally:
            stalled.set()
        httpd.shutdown()
    segment = session.episodes[-1].segments[-1]
    assert segment.stop.reason is StopReason.CANCELLED and segment.end == len(session.cache)
    assert session.cache.ids[segment.start:] == ids and len(segment.provenance) == len(ids)
    assert segment.provenance[0] is Provenance.FORCED and segment.steered_tokens is None

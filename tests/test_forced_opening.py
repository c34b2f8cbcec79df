"""A model segment as a backend returns it (SegmentStream: its result once its deltas are over), and a guide's
opening (SegmentRequest.forced: a claimed call), which enters the ids through the backend as the grammar's forced
tokens do: every token forced, the stop from the backend's stop check, and the model goes on after it where no stop
ended it. Both backends: in process (a model that writes planned tokens) and a model server (a loopback peer
answering as llama.cpp's server)."""

from __future__ import annotations

import pytest
import torch

from app.backends.base import SegmentRequest
from app.backends.server import LlamaCpp, ServerBackend
from app.backends.server_client import ModelServer
from app.engine.engine import Engine
from app.episode import Provenance, StopReason
from app.protocols.base import encode
from app.protocols.textenv.markers import SUBMIT
from app.settings import Settings
from tests.conftest import forced, plan_text, prime
from tests.http_peers import llama_stream, serve

SETTINGS = Settings(max_new_tokens=40, draft_tokens=0).validated(4096)
STOPS = (SUBMIT,)


def run(backend, cache, opening: str):
    """One segment whose opening is `opening`: its streamed text and its record."""
    with backend.lock:
        ids = tuple(encode(backend.tokenizer, opening))
    stream = backend.run_segment(cache, SETTINGS, None, SegmentRequest(STOPS, forced=ids), torch.Generator())
    return "".join(stream.deltas), stream.result(), len(ids)


def test_a_segments_result_is_read_once_its_deltas_are_over(tiny_llama, tokenizer):
    backend = forced(tiny_llama, plan_text(tokenizer, (0, "hello there, my friend")))
    session = prime(Engine(backend))
    stream = backend.run_segment(session.cache, SETTINGS, None, SegmentRequest(STOPS), torch.Generator())
    with pytest.raises(RuntimeError, match="once its deltas are over"):
        stream.result()
    next(stream.deltas)
    with pytest.raises(RuntimeError, match="once its deltas are over"):
        stream.result()
    stream.deltas.close()
    assert stream.result().stop.reason is StopReason.CANCELLED and session.cache.check() is None


def test_in_process_a_whole_reply_is_forced_and_no_pass_runs(tiny_llama, tokenizer):
    backend = forced(tiny_llama, plan_text(tokenizer, (0, "never")))
    session = prime(Engine(backend))
    start, steps = len(session.cache), backend.scheduler.stats.steps
    text, segment, n = run(backend, session.cache, "<request><Calculator>2 + 2<call>" + SUBMIT)
    assert text == "<request><Calculator>2 + 2<call>" + SUBMIT
    assert segment.stop.reason is StopReason.STRING_MATCH and segment.stop.string == SUBMIT
    assert segment.provenance == [Provenance.FORCED] * n and segment.generated_tokens == 0
    assert len(session.cache) == start + n and backend.scheduler.stats.steps == steps  # the model never ran


def test_in_process_the_model_goes_on_after_an_opening(tiny_llama, tokenizer):
    backend = forced(tiny_llama, plan_text(tokenizer, (0, " 5" + SUBMIT)))
    session = prime(Engine(backend))
    text, segment, n = run(backend, session.cache, "Result =")
    written = len(encode(tokenizer, " 5" + SUBMIT))
    assert text == "Result = 5" + SUBMIT and segment.stop.string == SUBMIT
    assert segment.provenance == [Provenance.FORCED] * n + [Provenance.MODEL] * written
    assert segment.generated_tokens == written


def on_a_server(tokenizer, opening: str, reply: str):
    """One segment with `opening` on a loopback peer that streams `reply` as llama.cpp would: its text, its record,
    the opening's length and the requests the peer got."""
    requests = []
    httpd, url = serve(llama_stream(tokenizer, reply, SUBMIT), requests=requests)
    with httpd:
        backend = ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), tokenizer, 4096)
        session = Engine(backend).new_session(use_cache=False)
        text, segment, n = run(backend, session.cache, opening)
        httpd.shutdown()
    return text, segment, n, requests


def test_on_a_server_a_whole_reply_is_forced_here_and_no_request_is_sent(server_tokenizer):
    text, segment, n, requests = on_a_server(server_tokenizer, "<request><Calculator>2 + 2<call>" + SUBMIT, "never")
    assert text.endswith(SUBMIT) and segment.stop.string == SUBMIT and not requests
    assert segment.provenance == [Provenance.FORCED] * n and segment.generated_tokens == 0
    assert segment.prefill_tokens == segment.cached_tokens == 0


def test_on_a_server_the_completion_goes_on_after_an_opening(server_tokenizer):
    text, segment, n, (sent,) = on_a_server(server_tokenizer, "Result =", " 5")
    written = len(encode(server_tokenizer, " 5" + SUBMIT))
    assert sent["prompt"][-n:] == list(encode(server_tokenizer, "Result =")) and sent["n_predict"] == 40 - n
    assert text == "Result = 5" + SUBMIT and segment.stop.string == SUBMIT
    assert segment.provenance == [Provenance.FORCED] * n + [Provenance.MODEL] * written
    assert segment.generated_tokens == written and segment.prefill_tokens == 5

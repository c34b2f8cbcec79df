"""How server reports become stops and counts, on events shaped as the servers document them (vLLM's stream
chunks cannot be produced here without a GPU; scripts/check_vllm.sh runs the real checks), and how counts a
server did not report are shown: "not reported", never a number."""

from __future__ import annotations

import json

import pytest

from app.backends.base import BackendError
from app.backends.server import End, LlamaCpp, ServerBackend, Vllm
from app.backends.server_client import ModelServer
from app.decoding.stops import Stop, StopReason
from app.engine.comparisons import Comparison
from app.engine.engine import Engine
from app.episode import Episode, Provenance, Segment
from app.protocols.textenv.markers import CALL, STOP_STRINGS
from app.protocols.base import encode
from app.settings import Settings
from components.chat import segment_footer
from components.compare import compare_markdown
from components.timing import prefill_frame, timing_summary
from tests.http_peers import serve, serve_get

SERVER = ModelServer("http://127.0.0.1:9")


def chunk(text="", token_ids=(5,), finish=None, **extra) -> dict:
    choice = {"index": 0, "text": text, "token_ids": list(token_ids), "finish_reason": finish, **extra}
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


def test_vllm_stop_reasons():
    vllm = Vllm("m")
    assert vllm.parse(chunk("a"), SERVER).end is None
    assert vllm.parse(chunk(CALL, finish="stop", stop_reason=CALL), SERVER).end == End("string", CALL)
    assert vllm.parse(chunk(finish="stop", stop_reason=None), SERVER).end == End("eos")  # EOS: no stop_reason
    assert vllm.parse(chunk(finish="stop", stop_reason=2), SERVER).end == End("eos")  # a stop token id
    assert vllm.parse(chunk(finish="length"), SERVER).end == End("limit")
    with pytest.raises(BackendError, match="does not say which stop"):
        vllm.parse(chunk(finish="stop"), SERVER)  # an older server without stop_reason: not guessed
    with pytest.raises(BackendError, match="returned no token_ids"):
        vllm.parse({"choices": [{"index": 0, "text": "a", "token_ids": None, "finish_reason": None}]}, SERVER)


def test_vllm_usage_with_and_without_cached_tokens():
    vllm = Vllm("m")
    usage = {"prompt_tokens": 700, "completion_tokens": 9, "total_tokens": 709}
    reported = vllm.parse({"choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 688}}},
                          SERVER)
    assert (reported.prefill, reported.cached) == (12, 688)
    silent = vllm.parse({"choices": [], "usage": {**usage, "prompt_tokens_details": None}}, SERVER)
    assert (silent.prefill, silent.cached) == (None, None)  # without --enable-prompt-tokens-details


def test_vllm_requests_ids_stops_and_a_salt_when_the_cache_is_off():
    on = Vllm("m").request([1, 2, 3], Settings(), 16, 7, stops=STOP_STRINGS)  # (the protocol's, from the engine)
    off = Vllm("m").request([1, 2, 3], Settings(use_cache=False), 16, 7)
    assert on["prompt"] == [1, 2, 3] and on["max_tokens"] == 16 and on["return_token_ids"] is True
    assert on["include_stop_str_in_output"] is True and CALL in on["stop"] and "cache_salt" not in on
    assert off["cache_salt"] != Vllm("m").request([1], Settings(use_cache=False), 1, 0)["cache_salt"]


def test_llama_cpp_word_stop_puts_the_stop_string_back_into_the_text():
    piece = LlamaCpp().parse({"content": "", "tokens": [], "stop": True, "stop_type": "word", "stopping_word": CALL,
                              "tokens_predicted": 9, "timings": {"prompt_n": 3, "cache_n": 55}}, SERVER)
    assert piece.end == End("string", CALL) and piece.text == CALL and (piece.prefill, piece.cached) == (3, 55)


def test_missing_ids_of_a_split_character_are_rebuilt_from_the_text(server_tokenizer):
    """llama.cpp streams no ids for a token that ends inside a UTF-8 character: the segment is re-tokenized."""
    events = [{"content": "é!", "tokens": [0], "stop": False, "tokens_predicted": 2},  # token 1 of 2 never came
              {"content": "", "tokens": [], "stop": True, "stop_type": "eos", "stopping_word": "",
               "tokens_predicted": 2, "timings": {"prompt_n": 5, "cache_n": 0}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
    httpd, url = serve(body)
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), server_tokenizer, 4096))
        session = engine.new_session(use_cache=False)
        segment = engine.ask(session, "Say é!", Settings(max_new_tokens=8, max_turns=0, guide=False)).segments[0]
        httpd.shutdown()
    assert segment.stop.reason is StopReason.EOS
    assert session.cache.ids[segment.start:] == encode(server_tokenizer, "é!") and segment.text == "é!"


def test_a_guided_segment_rebuilt_from_its_text_has_the_provenance_of_its_rebuilt_ids(server_tokenizer):
    ids = encode(server_tokenizer, "Result = é!")
    events = [{"content": "Result = é!", "tokens": ids[:-2], "stop": False, "tokens_predicted": len(ids)},
              {"content": "", "tokens": [], "stop": True, "stop_type": "eos", "stopping_word": "",
               "tokens_predicted": len(ids), "timings": {"prompt_n": 5, "cache_n": 0}}]
    httpd, url = serve("".join(f"data: {json.dumps(e)}\n\n" for e in events).encode())
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), LlamaCpp(), server_tokenizer, 4096))
        session = engine.new_session(use_cache=False)
        segment = engine.ask(session, "Say é!", Settings(max_new_tokens=16, max_turns=0, guide=True)).segments[0]
        httpd.shutdown()
    assert session.cache.ids[segment.start:] == ids and len(segment.provenance) == len(ids)
    assert segment.provenance[0] is Provenance.FORCED and segment.steered_tokens is None


def test_vllm_gets_the_guides_grammar_as_structured_outputs(server_tokenizer):
    """vLLM's current field; its old `guided_grammar` / `guided_regex` are ignored without a word since v0.12."""
    text = "Result = 5<submit>"
    answer = chunk(text, encode(server_tokenizer, text), finish="stop", stop_reason="<submit>")
    requests = []
    httpd, url = serve(f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n".encode(), requests=requests)
    with httpd:
        engine = Engine(ServerBackend(ModelServer(url, timeout_s=5), Vllm("m"), server_tokenizer, 4096))
        guided = Settings(max_new_tokens=16, max_turns=0, guide=True)
        episode = engine.ask(engine.new_session(use_cache=False), "Hi!", guided)
        free = engine.ask(engine.new_session(use_cache=False), "Hi!", Settings(max_new_tokens=16, max_turns=0,
                                                                               guide=False))
        httpd.shutdown()
    on, off = requests
    assert on["structured_outputs"] == {"grammar": engine.guide(guided, None, None, calls=False).grammar}
    assert not {"guided_grammar", "guided_regex", "grammar"} & set(on)
    assert "structured_outputs" not in off and not {"guided_grammar", "guided_regex", "grammar"} & set(off)
    segment = episode.segments[-1]
    assert episode.answer == "Result = 5" and segment.forced_tokens > 0 and segment.steered_tokens is None
    assert free.answer == "Result = 5" and free.segments[-1].provenance is None


def test_counts_a_server_did_not_report_show_as_not_reported():
    segment = Segment("model", "hi", 10, 12, stop=Stop(StopReason.EOS), prefill_tokens=None, cached_tokens=None,
                      generated_tokens=2, ms=5.0)
    episode = Episode("q", 0, 10, True, "vllm server http://x", segments=[segment], ms=5.0)
    assert "prefill and cache reuse not reported by the model server" in segment_footer(segment)
    assert episode.prefill_tokens is None and episode.to_json()["cache"]["prefill_tokens"] is None
    assert prefill_frame([episode]).empty  # no bars rather than made-up zeros
    assert "not reported tokens prefilled" in timing_summary([episode])
    table = compare_markdown(Comparison(episode, episode, 1.0, 1.0))
    assert "| tokens prefilled, all segments | not reported | not reported |" in table


@pytest.mark.parametrize("top_k", [0, 40])
def test_both_servers_are_sent_the_top_k_setting(top_k):
    settings = Settings(temperature=0.7, top_k=top_k)
    assert LlamaCpp().request([1], settings, 4, 0)["top_k"] == top_k  # (llama.cpp: 0 = all tokens)
    assert Vllm("m").request([1], settings, 4, 0).get("top_k", 0) == top_k


@pytest.mark.parametrize("route, expected", [
    ((200, [{"id": 0, "path": "/app/assets/adapter/adapter.gguf", "scale": 1.0}]), "adapter.gguf ×1.0"),
    ((200, [{"id": 0, "path": "a.gguf", "scale": 0.0}]), None),  # (loaded, not applied: --lora-init-without-apply)
    ((200, []), None),
    (None, None),  # (a server without the route: 404)
])
def test_llama_cpp_says_which_lora_adapters_it_applies(route, expected):
    httpd, url = serve_get({"/lora-adapters": route} if route else {})
    try:
        assert LlamaCpp().adapters(ModelServer(url)) == expected
    finally:
        httpd.shutdown()

"""The server backend against a real llama.cpp server (built by scripts/build_llama_server.sh) on the bundled
GGUF, on loopback. llama.cpp's output differs from the in-process float32 path, so these tests check behaviour
(tool calls, stop reasons recorded from the server, ids, cache reuse), not token identity.

Most tests run with the guide off: they check what the server writes and reports itself (with the guide on, a
question a tool claims opens with the call the guide forces, which no request carries). The guided tests send each
segment's grammar through a recording proxy (tests/http_peers.proxy).

TEXTENV_TEST_SERVER_URL runs the same checks against a server that is already running (scripts/check_vllm.sh
does this for vLLM); the tests that start, kill or inspect llama.cpp's own server are skipped then."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
import time
import types
from dataclasses import replace

import gradio as gr
import pytest

from app.backends.base import BackendError
from app.model.adapter import GGUF_FILE
from app.model.loading import adapter_choice
from tests.support.llama_server import LlamaServer, free_port
from app.backends.server import ServerBackend
from app.backends.server_client import ModelServer
from app.decoding.stops import Limit, StopReason
from app.engine.comparisons import compare
from app.protocols.textenv.prompt import default_prompt_template
from app.engine.engine import Engine
from app.episode import SegmentFinished, TextDelta
from app.episode import Provenance
from app.protocols.textenv.markers import CALL, CUT_STOPS, STOP_STRINGS
from app.settings import Settings
from components.compare import compare_markdown
from components.inputs import settings_from_dict
from tests.http_peers import proxy
from tests.support.page import new_page, page_settings

EXTERNAL = os.environ.get("TEXTENV_TEST_SERVER_URL")
llama_only = pytest.mark.skipif(EXTERNAL is not None, reason="starts, kills or inspects llama.cpp's own server")
SETTINGS = Settings(max_new_tokens=48, max_length=4096, guide=False)  # the server writes alone
GUIDED = replace(SETTINGS, guide=True)
STORIES = "You write very long stories.\n"  # no few-shot answers, which end a turn after a line or two
# (sums the model does not know by heart: since the prompt has more greetings answered without a tool, the server's
# Q4_1 model answers "What is 7 + 5?" with "Result = 12" directly)
QUESTIONS = {"What is 41 * 23?": ("41", "23", "943"), "What is 12 * 9?": ("12", "9", "108"),
             "What is 57 + 85?": ("57", "85", "142"), "What is 100 - 37?": ("100", "37", "63")}


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    """One llama-server for the session (4 slots of 4,096 tokens, 2 threads, loopback only), or the external one."""
    if EXTERNAL:
        yield EXTERNAL
        return
    with LlamaServer(log=tmp_path_factory.mktemp("llama") / "server.log") as server:
        yield server.url


@pytest.fixture(scope="session")
def backend(server_url, server_tokenizer) -> ServerBackend:
    return ServerBackend.connect(ModelServer(server_url, timeout_s=60), tokenizer=server_tokenizer,
                                 kind=os.environ.get("MODEL_SERVER_KIND") or None,
                                 model=os.environ.get("MODEL_SERVER_MODEL") or None)


@pytest.fixture(scope="session")
def engine(backend) -> Engine:
    return Engine(backend)


def text_of(backend, ids) -> str:
    return backend.tokenizer.decode(ids, skip_special_tokens=False)


def assert_stop_recorded(backend, session, segment, settings: Settings) -> None:
    """However the server's segment stopped (the model's words are the server's), its record says so in full and
    the session's ids agree: a check for every way, each of which fails the test if its record is wrong."""
    stop, ids = segment.stop, session.cache.ids[segment.start:segment.end]
    assert segment.generated_tokens <= settings.max_new_tokens
    if stop.reason is StopReason.STRING_MATCH:  # <submit>, or another of textenv's STOP_STRINGS
        assert stop.string in STOP_STRINGS and stop.limit is None
        if stop.string in CUT_STOPS:  # not part of the answer: its tokens left the ids
            assert stop.string not in text_of(backend, ids) and segment.generated_tokens > len(ids)
        else:  # the server cuts the stop word from its text; the session's ids still end with it, as in process
            assert text_of(backend, ids).endswith(stop.string) and segment.generated_tokens == len(ids)
    elif stop.reason is StopReason.EOS:
        assert (stop.string, stop.limit) == (None, None) and segment.generated_tokens == len(ids)
    elif stop.reason is StopReason.MAX_LENGTH:
        assert stop.string is None and segment.generated_tokens == len(ids)
        if stop.limit is Limit.MAX_NEW_TOKENS:
            assert segment.generated_tokens == settings.max_new_tokens
        else:
            assert stop.limit is Limit.MAX_LENGTH and segment.end == settings.max_length
    else:
        pytest.fail(f"a server's segment cannot stop by {stop}")


@llama_only
def test_detects_llama_cpp_and_its_context(backend, server_url):
    assert backend.dialect.kind == "llama.cpp"
    # (the server applies the adapter the in-process backend merges, by default the shipped one: --lora)
    served = f" + adapter {GGUF_FILE} ×1.0" if adapter_choice(bundled=True) is not None else ""
    assert backend.name == f"llama.cpp server {server_url}{served}"
    assert backend.context_limit == 4096  # -c 16384 shared by -np 4 slots


def test_calculator_episode_calls_the_tool_and_records_the_servers_stops(engine, backend):
    session = engine.new_session()
    episode = engine.ask(session, "What is 41 * 23?", SETTINGS)
    first, tool, last = episode.segments[0], episode.segments[1], episode.segments[-1]
    assert first.stop.reason is StopReason.STRING_MATCH and first.stop.string == CALL
    assert tool.kind == "tool" and tool.tool == "Calculator" and tool.ok
    assert "41" in tool.query and "23" in tool.query and tool.text.startswith("943")
    # the server cuts the stop word from its text; the session's ids still end with it, as in process
    assert text_of(backend, session.cache.ids[first.start:first.end]).endswith(CALL)
    assert last.kind == "model" and last.stop.string != CALL  # the answer after the tool's result
    assert_stop_recorded(backend, session, last, SETTINGS)
    assert episode.backend == backend.name and episode.to_json()["backend"] == backend.name
    assert episode.total_tokens == len(session.cache) and all(s.ms > 0 for s in episode.segments)
    # every model segment reports the server's prefill: new + reused = its start position
    for segment in episode.model_segments:
        assert segment.prefill_tokens + segment.cached_tokens == segment.start
        assert segment.generated_tokens == segment.end - segment.start


def test_search_episode(engine, backend):
    session = engine.new_session()
    episode = engine.ask(session, "What does kludge mean?", SETTINGS)
    first, tool = episode.segments[0], episode.segments[1]
    assert first.stop.string == CALL and tool.tool == "Search" and "kludge" in tool.query.lower()
    assert tool.ok and "kludge" in tool.text.lower()
    last = episode.segments[-1]
    assert last.kind == "model" and last.stop.string != CALL  # the answer after the tool's result
    assert_stop_recorded(backend, session, last, SETTINGS)


def test_max_new_tokens_and_max_length_stops(engine):
    session = engine.new_session()
    episode = engine.ask(session, "What is 41 * 23?", replace(SETTINGS, max_new_tokens=3, max_turns=0))
    (segment,) = episode.segments
    assert segment.stop.reason is StopReason.MAX_LENGTH and segment.stop.limit is Limit.MAX_NEW_TOKENS
    assert segment.generated_tokens == 3 and segment.end - segment.start == 3
    room = len(session.cache) + 20  # the next question (~12 tokens) leaves a few tokens: the session's limit
    episode = engine.ask(session, "What is 12 * 9?", replace(SETTINGS, max_length=room))
    last = episode.segments[-1]
    assert last.stop.reason is StopReason.MAX_LENGTH and last.stop.limit is Limit.MAX_LENGTH
    assert len(session.cache) == room


def test_second_turn_reuses_the_servers_prefix_cache_and_cache_off_reuses_nothing(engine):
    session = engine.new_session()
    engine.ask(session, "What is 12 * 9?", SETTINGS)
    before = len(session.cache)
    second = engine.ask(session, "What is 7 + 5?", SETTINGS).segments[0]
    # all of turn 1 comes from the server's cache, but for its last token (llama.cpp) or last partial block (vLLM)
    assert second.cached_tokens >= before - 16
    assert second.prefill_tokens == second.start - second.cached_tokens and second.prefill_tokens < 40
    off = engine.ask(session, "What is 100 - 37?", replace(SETTINGS, use_cache=False))
    first_off = off.segments[0]
    assert first_off.cached_tokens == 0 and first_off.prefill_tokens == first_off.start  # cache_prompt: false


def test_stop_mid_segment_closes_the_stream_and_the_session_stays_usable(engine, backend):
    """Regression (issue 42): the server's stop was checked by a 5 s wait for an idle slot, which a loaded machine
    missed; now by the server's own count of the tokens it generated, once its slots are idle."""
    session = engine.new_session(STORIES)
    cancel = threading.Event()
    long = replace(SETTINGS, max_new_tokens=400, max_turns=0)
    events = []
    before = tokens_predicted(backend)
    for event in engine.turn(session, "Write a long story about a robot.", long, cancel=cancel):
        events.append(event)
        if isinstance(event, TextDelta):
            cancel.set()
    (segment,) = [e.segment for e in events if isinstance(e, SegmentFinished)]
    assert segment.stop.reason is StopReason.CANCELLED and 1 <= segment.generated_tokens < 400
    assert segment.end == len(session.cache)
    assert generated_after(backend, before) < 400  # the server stopped generating
    # closing the turn (the page's Stop between two yields) closes the stream too
    before = tokens_predicted(backend)
    turn = engine.turn(session, "Tell me another long story.", long)
    for event in turn:
        if isinstance(event, TextDelta):
            turn.close()
    assert session.episodes[-1].segments[-1].stop.reason is StopReason.CANCELLED
    assert generated_after(backend, before) < 400
    last = engine.ask(session, "What is 12 * 9?", SETTINGS).segments[0]
    assert last.stop.reason not in (StopReason.CANCELLED, StopReason.ERROR) and last.generated_tokens > 0


def tokens_predicted(backend) -> int | None:
    """llama.cpp's count of every token its slots generated (`/metrics`, which LlamaServer turns on); None for
    other servers, which show no such count."""
    if backend.dialect.kind != "llama.cpp":
        return None
    with urllib.request.urlopen(backend.server.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    (line,) = [line for line in text.splitlines() if line.startswith("llamacpp:tokens_predicted_total ")]
    return int(float(line.split()[1]))


def generated_after(backend, before: int | None, hang_s: float = 300.0) -> int:
    """Tokens the server generated since `before`, counted once no slot is busy (`hang_s` only guards a hang:
    a server that ran on to the segment's max_new_tokens is caught by the count, not by the clock). 0 where the
    server keeps no count."""
    if before is None:
        return 0
    end = time.monotonic() + hang_s
    while any(slot["is_processing"] for slot in backend.server.get_json("/slots")):
        assert time.monotonic() < end, f"a slot is still busy after {hang_s:.0f} s"
        time.sleep(0.1)
    return tokens_predicted(backend) - before


@llama_only
def test_server_killed_mid_turn_is_a_clear_error_and_the_next_turn_works_after_a_restart(server_tokenizer, tmp_path):
    with LlamaServer(ctx=4096, parallel=1, log=tmp_path / "server.log") as llama:
        engine = Engine(ServerBackend.connect(ModelServer(llama.url, timeout_s=30), tokenizer=server_tokenizer))
        session = engine.new_session(STORIES)
        engine.ask(session, "What is 12 * 9?", SETTINGS)
        before = list(session.cache.ids)
        with pytest.raises(BackendError, match=f"model server {llama.url}"):
            for event in engine.turn(session, "Write a long story about a robot.",
                                     replace(SETTINGS, max_new_tokens=400, max_turns=0)):
                if isinstance(event, TextDelta):
                    llama.stop()
        failed = session.episodes[-1].segments[-1]
        assert failed.stop.reason is StopReason.ERROR and failed.start == failed.end  # rolled back
        assert session.cache.ids[:len(before)] == before and len(session.cache) == session.episodes[-1].query_end
        with pytest.raises(BackendError, match="is not reachable: connection refused"):
            engine.ask(session, "What is 7 + 5?", SETTINGS)
        llama.start()
        first = engine.ask(session, "What is 41 * 23?", SETTINGS).segments[0]  # the same session goes on
        assert first.stop.reason is not StopReason.ERROR and first.end <= first.start + first.generated_tokens
        assert first.cached_tokens == 0 and first.prefill_tokens == first.start  # a restarted server's cache is empty
        episode = engine.ask(engine.new_session(), "What is 41 * 23?", SETTINGS)
        assert episode.segments[0].stop.string == CALL and episode.segments[1].text.startswith("943")


def test_several_sessions_at_once_get_their_own_answers(engine):
    results: dict[str, object] = {}

    def chat(question: str) -> None:
        try:
            results[question] = engine.ask(engine.new_session(), question, SETTINGS)
        except Exception as error:  # collected and asserted below: a thread must not swallow it
            results[question] = error

    threads = [threading.Thread(target=chat, args=(q,)) for q in QUESTIONS]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(thread.is_alive() for thread in threads), "a session did not finish within 240 s"
    assert time.monotonic() - began < 240
    for question, (a, b, result) in QUESTIONS.items():
        episode = results[question]
        assert not isinstance(episode, Exception), episode
        tool = episode.segments[1]
        assert tool.tool == "Calculator" and a in tool.query and b in tool.query, (question, tool.query)
        assert tool.text.startswith(result), (question, tool.text)


def test_cli_ask_names_the_server_and_a_dead_server_is_one_error_line(backend):
    env = {**os.environ, "MODEL_SERVER_URL": backend.server.url}
    done = subprocess.run([sys.executable, "-m", "app", "ask", "What is 41 * 23?", "--json", "--max-length", "4096"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    episode = json.loads(done.stdout)
    assert episode["backend"] == backend.name
    assert episode["segments"][0]["stop_string"] == CALL and episode["segments"][1]["tool"] == "Calculator"
    dead = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "app", "ask", "What is 41 * 23?"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MODEL_SERVER_URL": dead})
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: model server {dead} is not reachable: connection refused"


@llama_only
def test_defaults_fit_slots_of_2048_tokens_and_a_longer_max_length_is_still_refused(server_tokenizer, tmp_path):
    """Against `llama-server -c 4096 -np 2` (2,048 tokens a slot) `ask` with default settings answers (its default
    max_length, 4,096, was refused: a setting the user never set), and so does the API; a max_length given above
    the slot is refused with the check's message."""
    with LlamaServer(ctx=4096, parallel=2, log=tmp_path / "server.log") as llama:
        env = {**os.environ, "MODEL_SERVER_URL": llama.url}
        done = subprocess.run([sys.executable, "-m", "app", "ask", "What is 2+2?"], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        assert "answer: " in done.stdout and f"llama.cpp server {llama.url}" in done.stdout
        done = subprocess.run([sys.executable, "-m", "app", "ask", "What is 2+2?", "--max-length", "4096"],
                              capture_output=True, text=True, timeout=300, env=env)
        assert (done.returncode, done.stderr) == (2, "error: max_length must be between 1 and 2048\n")
        backend = ServerBackend.connect(ModelServer(llama.url, timeout_s=60), tokenizer=server_tokenizer)
        page = new_page(lambda: backend, budget_bytes=1 << 30)
        assert backend.context_limit == 2048
        assert page.service.choose(settings_from_dict(None)).settings.max_length == 2048
        assert page.api.ask("What is 2+2?", {"max_new_tokens": 16})["backend"] == backend.name
        with pytest.raises(gr.Error) as caught:
            page.api.ask("What is 2+2?", {"max_length": 4096})
        assert caught.value.message == "max_length must be between 1 and 2048"


def page_chat(page, message: str, tools=("Calculator", "Search"), guide: bool | None = None) -> list:
    """Every update of one turn sent from the page's Chat tab (as the visitor page-1), on the page's settings."""
    visitor = types.SimpleNamespace(session_hash="page-1")
    submitted = {"message": message, "ticket": None, "sent": None}
    settings = page_settings(max_new_tokens=48, tools=tools, prompt=service_prompt(), guide=guide)
    return list(page.chat.turn(submitted, settings, visitor))


def test_page_and_api_on_the_server_backend(backend):
    page = new_page(lambda: backend, budget_bytes=1 << 30)
    shown = page_chat(page, "What is 41 * 23?")[-1]
    chat, status, stats = shown.chat, shown.status, shown.stats
    assert status == "done · protocol textenv" and "string match `<call>`" in chat[1]["content"]
    assert f"Model: {backend.name}" in stats and "live on the model server" in stats
    assert page.api.ask("What is 12 * 9?")["backend"] == backend.name


def test_page_and_api_say_when_the_server_is_down():
    dead = f"http://127.0.0.1:{free_port()}"
    page = new_page(lambda: ServerBackend.connect(ModelServer(dead, timeout_s=5)), budget_bytes=1 << 30)
    outputs = page_chat(page, "What is 41 * 23?", tools=["Calculator"])
    assert outputs[-1].status == f"error: model server {dead} is not reachable: connection refused"
    assert outputs[-1].msg == "What is 41 * 23?"  # the message goes back to the box
    with pytest.raises(gr.Error, match="is not reachable: connection refused"):
        page.api.ask("What is 41 * 23?")


def service_prompt() -> str:
    return default_prompt_template()


def test_compare_maps_the_cache_switch_to_the_servers_prompt_cache(engine):
    session = engine.new_session()
    engine.ask(session, "What is 12 * 9?", SETTINGS)
    result = compare(engine, session, "What is 41 * 23?", SETTINGS)
    on, off = result.cached.segments[0], result.uncached.segments[0]
    assert on.cached_tokens >= on.start - 16 and off.cached_tokens == 0 and off.prefill_tokens == off.start
    assert not result.stopped and len(session.episodes) == 1  # forks: the chat itself is unchanged
    assert f"| tokens reused, all segments | {result.cached.reused_tokens} | 0 |" in compare_markdown(result)


# ---- guided answers (app.decoding.guide) on the server: the grammar goes with the request ---------------------------------
REJECTED = ("model server {url} rejected the guide's grammar (HTTP 400: Failed to initialize samplers: failed to "
            "parse grammar): switch guided answers off (the page's Guided answers, `guide: false` in the API, "
            "--no-guide in the CLI) to ask it without one")


@pytest.fixture(scope="module")
def proxied(server_url, server_tokenizer):
    """An engine whose requests go through a proxy that records them (httpd.requests: (path, body) pairs)."""
    httpd, url = proxy(server_url)
    with httpd:
        engine = Engine(ServerBackend.connect(ModelServer(url, timeout_s=60), tokenizer=server_tokenizer,
                                              kind=os.environ.get("MODEL_SERVER_KIND") or None,
                                              model=os.environ.get("MODEL_SERVER_MODEL") or None))
        yield engine, httpd
        httpd.shutdown()


def completions(httpd) -> list[dict]:
    """The segments' requests (not the tokenizer's, nor the prompt's warm-up), in order."""
    return [body for path, body in httpd.requests if path in ("/completion", "/v1/completions") and body.get("stream")]


def grammar_of(body: dict) -> str | None:
    return body.get("grammar") or (body.get("structured_outputs") or {}).get("grammar")


@pytest.mark.parametrize("question, tool, begins", [
    ("What is 41 * 23?", "Calculator", "Result = 943"),
    ("What does grok mean?", "Search", "Result = grok: To understand."),
])
def test_guide_on_the_answer_begins_with_the_tools_output_and_its_tokens_say_who_chose_them(proxied, question,
                                                                                            tool, begins):
    engine, httpd = proxied
    httpd.requests.clear()
    episode = engine.ask(engine.new_session(), question, GUIDED)
    call, output, answer = episode.segments  # the call is claimed: forced, no request
    assert output.kind == "tool" and output.tool == tool and output.ok
    assert episode.answer.startswith(begins), episode.answer
    if tool == "Calculator":
        assert not episode.answer[len(begins):][:1].isdigit()  # 943, not 9431
    (sent,) = completions(httpd)  # the answer's request carries the engine's grammar for it
    assert grammar_of(sent) == engine.guide(GUIDED, None, output, calls=True).grammar
    assert call.provenance == [Provenance.FORCED] * (call.end - call.start) and call.generated_tokens == 0
    ids = episode.token_ids[answer.start - episode.query_start:answer.end - episode.query_start]
    assert len(answer.provenance) == len(ids) and set(answer.provenance) <= {Provenance.MODEL, Provenance.FORCED}
    forced = "".join(engine.backend.tokenizer.decode([t]) for t, p in zip(ids, answer.provenance)
                     if p is Provenance.FORCED)
    assert begins.split("= ", 1)[1] in forced  # the tool's text is the grammar's, not the model's
    assert answer.generated_tokens == len(ids) - answer.forced_tokens
    assert answer.steered_tokens is None  # a server does not say which tokens its grammar steered
    data = episode.to_json()
    assert data["guide"] is True
    assert data["segments"][2]["guided"] == {"forced_tokens": answer.forced_tokens, "steered_tokens": None}


def test_guide_off_the_server_writes_freely(proxied):
    engine, httpd = proxied
    httpd.requests.clear()
    episode = engine.ask(engine.new_session(), "What is 41 * 23?", SETTINGS)
    sent = completions(httpd)
    assert len(sent) == len(episode.model_segments) == 2  # the call is the model's too: no claimed call
    assert all("grammar" not in body and "structured_outputs" not in body for body in sent)
    assert all(s.provenance is None and s.generated_tokens == s.end - s.start for s in episode.model_segments)
    data = episode.to_json()
    assert data["guide"] is False and all(s["guided"] == {"forced_tokens": 0, "steered_tokens": 0}
                                          for s in data["segments"] if s["kind"] == "model")


@llama_only
def test_a_grammar_the_server_rejects_is_a_clear_error_in_page_api_and_cli_and_the_session_goes_on(
        server_url, server_tokenizer):
    """llama.cpp's own answer to a grammar it cannot parse (HTTP 400), through a proxy that breaks the grammar
    of every guided request until `broken` is cleared."""
    broken = threading.Event()
    broken.set()

    def change(path: str, body: dict) -> dict:
        return {**body, "grammar": "root ::= ("} if broken.is_set() and "grammar" in body else body

    httpd, url = proxy(server_url, change)
    with httpd:
        expected = REJECTED.format(url=url)
        backend = ServerBackend.connect(ModelServer(url, timeout_s=60), tokenizer=server_tokenizer)
        engine = Engine(backend)
        session = engine.new_session()
        with pytest.raises(BackendError) as caught:
            engine.ask(session, "What is 41 * 23?", GUIDED)
        assert str(caught.value) == expected
        failed = session.episodes[-1].segments[-1]
        assert failed.stop.reason is StopReason.ERROR and failed.start == failed.end == len(session.cache)
        # the same session answers its next question (the guide off: no grammar for the server to reject)
        episode = engine.ask(session, "What is 12 * 9?", SETTINGS)
        assert episode.error is None and episode.segments[1].text.startswith("108")

        page = new_page(lambda: backend, budget_bytes=1 << 30)
        outputs = page_chat(page, "What is 41 * 23?", guide=True)
        assert outputs[-1].status == f"error: {expected}"
        with pytest.raises(gr.Error, match="rejected the guide's grammar") as caught:
            page.api.ask("What is 12 * 9?", {"guide": True})
        assert expected in str(caught.value)
        assert "error" not in page.api.ask("What is 12 * 9?", {"guide": False})

        env = {**os.environ, "MODEL_SERVER_URL": url}
        ask = ["ask", "What is 41 * 23?", "--max-length", "4096", "--guide"]
        done = subprocess.run([sys.executable, "-m", "app", *ask],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 1 and f"[error: {expected}]" in done.stdout, (done.stdout, done.stderr)

        broken.clear()  # the page's session goes on: its next guided turn is answered
        outputs = page_chat(page, "What is 41 * 23?", guide=True)
        assert outputs[-1].status == "done · protocol textenv"
        assert page.service.store.get("page-1").session.episodes[-1].answer.startswith("Result = 943")
        httpd.shutdown()


@pytest.mark.parametrize("guide", [False, True])
def test_chat_protocol_through_the_server(backend, guide):
    """The chat protocol's ids in, the server's tokens out: it stops at `</tool_call>` (the stop string sent with
    the request), the result goes back as the template's ids, the answer ends at EOS; with the guide on, the
    grammar (sent as `grammar`) keeps the call to the session's tools."""
    engine = Engine(backend, protocol="chat")
    session = engine.new_session()
    settings = replace(SETTINGS, guide=guide, max_new_tokens=64)
    episode = engine.ask(session, "What is 41 * 23?", settings)
    model, tool, answer = episode.segments
    assert (model.stop.reason, model.stop.string) == (StopReason.STRING_MATCH, "</tool_call>")
    assert text_of(backend, session.cache.ids[model.start:model.end]).endswith("</tool_call>")
    assert tool.result == "943" and answer.stop.reason is StopReason.EOS
    assert episode.answer == "Result = 943" and episode.protocol == "chat"

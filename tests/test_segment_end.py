"""How a model segment ends, in process: each end is recorded once, by the code that stopped it, and a segment cut
short by an error still says what it did; a failure in one row's per-token work ends that row alone."""

from __future__ import annotations

import app.backends.row as row
from app.engine.engine import Engine
from app.episode import Provenance, StopReason
from app.settings import Settings


def test_a_failure_in_one_rows_token_work_ends_that_row_alone(tiny_llama, monkeypatch):
    """Row 1's third choice of tokens raises (after its pass, in the scheduler's thread): its segment says error,
    keeps the two tokens it took, and its episode says why; row 0, beside it, gets its solo episode."""
    engine = Engine(tiny_llama)
    settings = Settings(max_new_tokens=8, max_turns=0, guide=False)
    alone = engine.run(["Say something."], settings)[0]
    real, calls = row.choose_tokens, []

    def choose(logits, drafts, temperature, top_p, generator, *rest):
        if generator.initial_seed() == 1:  # (row 1: seed + 1)
            calls.append(None)
            if len(calls) == 3:
                raise RuntimeError("sampling failed (simulated)")
        return real(logits, drafts, temperature, top_p, generator, *rest)

    monkeypatch.setattr(row, "choose_tokens", choose)
    mine, failed = engine.run(["Say something.", "Say something else."], settings)
    assert mine.token_ids == alone.token_ids and mine.error is None
    assert failed.error == "sampling failed (simulated)"
    (segment,) = failed.segments
    assert segment.stop.reason is StopReason.ERROR and segment.stop.label == "error"
    assert segment.end - segment.start == segment.generated_tokens == 2 == len(failed.token_ids) - (
        failed.query_end - failed.query_start)


def test_a_claimed_call_is_the_guides_forced_reply(tiny_llama):
    """A call a tool claims is the guide's opening, every token forced (log-probability 0.0), and ends at its stop
    string (the backend's stop check); the model runs only after the tool."""
    engine = Engine(tiny_llama)
    episode = engine.ask(engine.new_session(), "What is 2 + 2?",
                         Settings(max_new_tokens=32, max_turns=1, guide=True, logprobs=True))
    call = episode.segments[0]
    n = call.end - call.start
    assert call.text == "<request><Calculator>2 + 2<call>" and call.stop.string == "<call>"
    assert call.provenance == [Provenance.FORCED] * n and call.logprobs == [0.0] * n
    assert (call.generated_tokens, call.prefill_tokens, call.cached_tokens) == (0, 0, 0)
    assert episode.segments[1].kind == "tool" and episode.segments[2].kind == "model"

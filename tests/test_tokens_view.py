"""The token view (components/tokens.py): each span decoded once, coloured by who wrote it, the guide's tokens
apart."""

from __future__ import annotations

import gradio as gr

from app.episode import Provenance, Segment, Span
from components.tokens import COLOR_MAP, guided_spans, token_counts, token_spans, token_summary


def test_token_spans_decode_each_span_once():
    ids = list(range(12))
    spans = [Span("system", 0, 4), Span("user", 4, 6), Span("model", 6, 9), Span("tool", 9, 10),
             Span("model", 10, 12)]
    calls = []

    def decode(chunk):
        calls.append(chunk)
        return "|".join(map(str, chunk))

    view = token_spans(ids, spans, decode)
    assert view == [("0|1|2|3", "system"), ("4|5", "user"), ("6|7|8", "model"), ("9", "tool"), ("10|11", "model")]
    assert len(calls) == len(spans)
    assert token_spans(ids, spans[:2], decode)[-1] == ("6|7|8|9|10|11", "model")
    assert token_counts(spans) == {"system": 4, "user": 2, "model": 5, "guide": 0, "tool": 1}
    assert token_summary(spans).endswith("total 12 tokens")
    assert set(COLOR_MAP) == {"system", "user", "model", "guide", "tool"}
    assert gr.HighlightedText(color_map=COLOR_MAP).postprocess(view).root[0].class_or_confidence == "system"


def test_the_token_view_colours_the_tokens_the_guide_chose():
    """Forced and steered tokens of a model segment are their own runs, "guide", beside the model's own; a
    segment the guide left alone (or ran without it) stays one "model" span; tool spans stay as they are."""
    M, F, S = Provenance.MODEL, Provenance.FORCED, Provenance.STEERED
    ids = list(range(16))
    spans = [Span("system", 0, 4), Span("user", 4, 6), Span("model", 6, 9), Span("tool", 9, 10),
             Span("model", 10, 16)]
    segments = [Segment("model", "call", 6, 9, provenance=None),  # the guide off
                Segment("tool", "out", 9, 10),
                Segment("model", "answer", 10, 16, provenance=[M, F, F, S, M, M])]
    split = guided_spans(spans, segments)
    assert [(s.role, s.start, s.end) for s in split] == [
        ("system", 0, 4), ("user", 4, 6), ("model", 6, 9), ("tool", 9, 10),
        ("model", 10, 11), ("guide", 11, 14), ("model", 14, 16)]
    view = token_spans(ids, split, lambda chunk: "|".join(map(str, chunk)))
    assert view[-3:] == [("10", "model"), ("11|12|13", "guide"), ("14|15", "model")]
    assert token_counts(split) == {"system": 4, "user": 2, "model": 6, "guide": 3, "tool": 1}
    highlighted = gr.HighlightedText(color_map=COLOR_MAP).postprocess(view).root
    assert [e.class_or_confidence for e in highlighted].count("guide") == 1
    assert COLOR_MAP["guide"] not in (COLOR_MAP[r] for r in ("system", "user", "model", "tool"))  # its own colour
    forced_only = [Segment("model", "call", 6, 9, provenance=[F, F, F])]  # (a claimed call: all the engine's)
    assert [s.role for s in guided_spans(spans[2:3], forced_only)] == ["guide"]
    short = [Segment("model", "x", 6, 9, provenance=[F])]  # provenance shorter than the span: the rest the model's
    assert [(s.role, s.end) for s in guided_spans(spans[2:3], short)] == [("guide", 7), ("model", 9)]

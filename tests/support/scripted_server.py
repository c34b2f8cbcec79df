"""A loopback stand-in for llama.cpp's server whose "model" writes a script (tests.conftest.script_rest), so that the
app's model-server code path (app.backends.server: LlamaCpp, the stream, the grammar's replay) runs on scripted
output. It keeps to a request's grammar as the real server does: a scripted token the grammar refuses is replaced
by EOS where the grammar may end, else by the lowest id it allows. It streams as llama.cpp does: one event a token,
text that may begin a stop string held back, the stop string cut from `content` and named in `stopping_word`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.decoding.guide_matcher import GuideVocab
from tests.conftest import script_rest
from tests.http_peers import serve


@dataclass
class Script:
    """What the scripted model writes: `pieces[i]` after the i-th tool output (`marker`); set per test case."""

    pieces: tuple[str, ...] = ("",)
    marker: str = "<response>"
    requests: int = 0


def scripted_llama_cpp(tokenizer, vocab: GuideVocab, eos: int, script: Script):
    """(httpd, url) of a scripted llama.cpp server for `tokenizer`."""

    def answer(body: dict) -> tuple[int, bytes]:
        if not body.get("stream"):  # (the prompt warm-up: nothing generated)
            return 200, json.dumps({"content": "", "tokens": []}).encode()
        script.requests += 1
        events = complete(tokenizer, vocab, eos, script, body)
        return 200, "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()

    return serve(answer)


def complete(tokenizer, vocab: GuideVocab, eos: int, script: Script, body: dict) -> list[dict]:
    prompt, limit, stops = body["prompt"], body["n_predict"], body.get("stop") or []
    matcher = vocab.matcher(body["grammar"]) if body.get("grammar") else None
    out: list[int] = []
    events, sent, end = [], 0, None
    while end is None and len(out) < limit:
        rest = script_rest(tokenizer, prompt + out, script.pieces, script.marker, specials=True)
        token = rest[0] if rest else eos
        if matcher is not None:
            allowed = matcher.allowed()
            if not allowed[token]:
                token = eos if allowed[eos] else int(allowed.argmax())
            if token != eos:
                matcher.consume([token])
        out.append(token)
        text = tokenizer.decode(out, skip_special_tokens=True)  # (llama.cpp renders no special token as text)
        hit = min(((text.find(s), s) for s in stops if s in text), default=None)  # (the first: it stops there)
        if token == eos:
            end, upto = {"stop_type": "eos", "stopping_word": ""}, len(text)
        elif hit is not None:
            end, upto = {"stop_type": "word", "stopping_word": hit[1]}, hit[0]
        else:
            held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            upto = len(text) - held
        events.append({"content": text[sent:upto], "tokens": [token], "stop": False, "tokens_predicted": len(out)})
        sent = max(sent, upto)
    end = end or {"stop_type": "limit", "stopping_word": ""}
    events.append({"content": "", "tokens": [], "stop": True, **end, "tokens_predicted": len(out),
                   "timings": {"prompt_n": len(prompt), "cache_n": 0}})
    return events

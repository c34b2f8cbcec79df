"""What each model server's API looks like: llama.cpp's server (`/completion`) and vLLM's OpenAI route
(`/v1/completions`), each a small dialect that writes a completion request and reads its streamed events into plain
Pieces (ids, text, counts, the end). Which one a URL serves is asked of the server (detect_kind)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.backends.base import BackendError
from app.backends.server_client import ModelServer, ServerHTTPError

if TYPE_CHECKING:
    from app.settings import Settings

KINDS = ("llama.cpp", "vllm")


@dataclass(frozen=True)
class End:
    """How the server says a completion ended: `string` (with the stop string), `eos` or `limit`."""

    kind: str
    string: str | None = None


@dataclass
class Piece:
    """What one streamed event adds: generated ids and their text, the server's counts, and the end if it came."""

    tokens: list[int]
    text: str = ""
    predicted: int | None = None  # tokens generated so far, per the server (llama.cpp), to catch missing ids
    prefill: int | None = None
    cached: int | None = None
    end: End | None = None


class LlamaCpp:
    """llama.cpp's native route: ids per token (`return_tokens`), `stop_type` / `stopping_word`, timings."""

    kind = "llama.cpp"
    path = "/completion"

    def context_limit(self, server: ModelServer) -> int:
        props = server.get_json("/props")
        n_ctx = _field(props, "default_generation_settings", dict, server).get("n_ctx")
        return _count(n_ctx, "n_ctx", server)

    def tokenize(self, server: ModelServer, text: str) -> list:
        return _field(server.post_json("/tokenize", {"content": text, "add_special": False}), "tokens", list, server)

    def adapters(self, server: ModelServer) -> str | None:
        """The LoRA adapters the server applies (`--lora`), as "file ×scale"; None where it applies none or does
        not say (a server without the route)."""
        try:
            listed = server.get_json("/lora-adapters")
        except ServerHTTPError:
            return None
        applied = [f"{str(a.get('path', '?')).rsplit('/', 1)[-1]} ×{a.get('scale')}" for a in listed
                   if isinstance(a, dict) and a.get("scale")] if isinstance(listed, list) else []
        return ", ".join(applied) or None

    def warm(self, server: ModelServer, ids: list[int]) -> None:
        server.post_json(self.path, {"prompt": ids, "n_predict": 0, "cache_prompt": True})  # evaluate, generate none

    def request(self, ids: list[int], settings: Settings, max_tokens: int, seed: int,
                grammar: str | None = None, stops: tuple[str, ...] = ()) -> dict:
        body = {"prompt": ids, "n_predict": max_tokens, "stream": True, "stop": list(stops),
                "cache_prompt": settings.use_cache, "return_tokens": True, "timings_per_token": True,
                "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k, "min_p": 0.0,
                "seed": seed}
        if grammar is not None:
            body["grammar"] = grammar  # GBNF
        return body

    def parse(self, event: dict, server: ModelServer) -> Piece:
        _raise_error_event(event, server)
        piece = Piece(tokens=_field(event, "tokens", list, server),
                      text=_field(event, "content", str, server),
                      predicted=_count(event.get("tokens_predicted"), "tokens_predicted", server))
        timings = event.get("timings")
        if isinstance(timings, dict):
            piece.prefill = _count(timings.get("prompt_n"), "timings.prompt_n", server)
            piece.cached = _count(timings.get("cache_n"), "timings.cache_n", server)
        if event.get("stop") is True:
            stop_type = event.get("stop_type")
            if stop_type == "word":
                word = event.get("stopping_word")
                piece.end = End("string", word)
                piece.text += word if isinstance(word, str) else ""  # the server cuts it out of `content`
            elif stop_type in ("eos", "limit"):
                piece.end = End(stop_type)
            else:
                raise BackendError(f"model server {server.url} ended a completion with stop_type {stop_type!r}")
        return piece


class Vllm:
    """vLLM's OpenAI route with its extras: token-id prompts, `return_token_ids`, `stop_reason`,
    `include_stop_str_in_output`, `cache_salt` (a fresh salt per request opts out of prefix-cache hits)."""

    kind = "vllm"
    path = "/v1/completions"

    def adapters(self, server: ModelServer) -> str | None:
        return None  # (a vLLM LoRA is a served model name of its own: MODEL_SERVER_MODEL)

    def __init__(self, model: str | None):
        self.model = model

    def context_limit(self, server: ModelServer) -> int:
        models = _field(server.get_json("/v1/models"), "data", list, server)
        chosen = next((m for m in models if isinstance(m, dict) and (self.model is None or m.get("id") == self.model)),
                      None)
        if chosen is None:
            raise BackendError(f"model server {server.url} does not serve {self.model or 'any model'}")
        self.model = chosen.get("id")
        return _count(chosen.get("max_model_len"), "max_model_len", server)

    def tokenize(self, server: ModelServer, text: str) -> list:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return _field(server.post_json("/tokenize", body), "tokens", list, server)

    def warm(self, server: ModelServer, ids: list[int]) -> None:
        server.post_json(self.path, {"model": self.model, "prompt": ids, "max_tokens": 1})  # vLLM needs >= 1

    def request(self, ids: list[int], settings: Settings, max_tokens: int, seed: int,
                grammar: str | None = None, stops: tuple[str, ...] = ()) -> dict:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "stop": list(stops),
                "include_stop_str_in_output": True, "return_token_ids": True,
                "temperature": settings.temperature, "top_p": settings.top_p, "seed": seed}
        if settings.top_k:
            body["top_k"] = settings.top_k
        if not settings.use_cache:
            body["cache_salt"] = uuid.uuid4().hex  # no earlier request shares it: nothing is reused
        if grammar is not None:  # (vLLM ignores the older `guided_grammar` without a word)
            body["structured_outputs"] = {"grammar": grammar}
        return body

    def parse(self, event: dict, server: ModelServer) -> Piece:
        _raise_error_event(event, server)
        piece = Piece(tokens=[])
        usage = event.get("usage")
        if isinstance(usage, dict):
            prompt = _count(usage.get("prompt_tokens"), "usage.prompt_tokens", server)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if cached is not None:  # reported only with --enable-prompt-tokens-details
                piece.cached = _count(cached, "cached_tokens", server)
                piece.prefill = prompt - piece.cached
        choices = _field(event, "choices", list, server)
        if not choices:
            return piece
        choice = choices[0]
        if not isinstance(choice, dict) or not isinstance(choice.get("token_ids"), list):
            raise BackendError(f"model server {server.url} returned no token_ids (vLLM needs `return_token_ids`, "
                               "v0.10.2 or later)")
        piece.tokens = choice["token_ids"]
        piece.text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        if finish == "length":
            piece.end = End("limit")
        elif finish == "stop":
            if "stop_reason" not in choice:
                raise BackendError(f"model server {server.url} does not say which stop ended the completion")
            reason = choice["stop_reason"]
            piece.end = End("string", reason) if isinstance(reason, str) else End("eos")  # None or a stop token id
        elif finish is not None:
            raise BackendError(f"model server {server.url} ended a completion with finish_reason {finish!r}")
        return piece


def detect_kind(server: ModelServer) -> str:
    """llama.cpp answers GET /props with its generation settings; vLLM does not, and lists its models as
    owned by "vllm". A server that answers neither must be named with MODEL_SERVER_KIND."""
    try:
        props = server.get_json("/props")
        if isinstance(props, dict) and "default_generation_settings" in props:
            return "llama.cpp"
    except ServerHTTPError:
        pass  # not llama.cpp (404): ask the OpenAI route
    models = server.get_json("/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in data):
        return "vllm"
    raise BackendError(f"model server {server.url} is neither llama.cpp's server nor vLLM; set MODEL_SERVER_KIND "
                       f"to one of {', '.join(KINDS)} if it speaks one of their APIs")


def _raise_error_event(event: dict, server: ModelServer) -> None:
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise BackendError(f"model server {server.url} failed during the completion: {message}")


def _field(value, name: str, kind: type, server: ModelServer):
    got = value.get(name) if isinstance(value, dict) else None
    if not isinstance(got, kind):
        raise BackendError(f"model server {server.url} sent malformed data: {name!r} is not a {kind.__name__} "
                           f"({str(value)[:120]})")
    return got


def _count(value, name: str, server: ModelServer) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BackendError(f"model server {server.url} sent malformed data: {name} = {value!r}")
    return value

"""The page's and the API's inputs as engine Settings, a tool list and a prompt, or a clear InputError: pure
functions, no Gradio, so every rule about what a visitor may send is tested without a server."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from app.serving import DEFAULTS, TurnSettings
from app.settings import PROTOCOLS, InputError, Settings, default_protocol
from app.tools import default_tools

SETTING_KEYS = ("max_new_tokens", "max_length", "max_turns", "max_tool_response", "temperature", "top_p",
                "top_k", "use_cache", "seed", "draft_tokens", "guide", "protocol")
FLAGS = ("use_cache", "guide")  # the settings that are true or false


MAX_PROMPT_CHARS = 8000


def tool_names() -> list[str]:
    return list(default_tools())


def page_protocol() -> str:
    """The Protocol selector's value when the page loads: the PROTOCOL environment variable's, else auto."""
    chosen = default_protocol()
    return chosen if chosen in PROTOCOLS else "auto"


def clean_prompt(prompt: str | None) -> str:
    """The page's system prompt template, or a clear InputError (empty, too long)."""
    if prompt is None or not prompt.strip():
        raise InputError("the system prompt is empty; write one (`{tools}` is replaced by the tool list)")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"the system prompt is too long ({len(prompt)} characters, at most {MAX_PROMPT_CHARS})")
    return prompt


def max_length_for(context_limit: int) -> int:
    """The page's and the API's default max_length on a backend that holds `context_limit` tokens a session."""
    return min(DEFAULTS.max_length, context_limit)


def make_settings(use_cache, max_length, max_new_tokens, max_turns, temperature, seed=0, guide=None,
                  protocol=None) -> Settings:
    """Settings from the page's controls: a new frozen value per turn; empty or non-numeric fields are errors.
    `guide`: the Guided answers checkbox (None: the default, off); `protocol`: the Protocol selector (one of
    PROTOCOLS; None: the default, app.settings.default_protocol). A max_length left at the page's default is not
    given (None): the page shows that value before it knows the backend, which may hold fewer tokens."""
    def number(name, value, kind):
        if value is None or value == "":
            raise InputError(f"{name} is empty; enter a number")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise InputError(f"{name} must be a number, not {value!r}") from None
        if kind is int and not as_float.is_integer():
            raise InputError(f"{name} must be a whole number, not {value!r}")
        return kind(as_float)

    if guide is not None and not isinstance(guide, bool):  # (a checkbox sends true or false; a raw call may not)
        raise InputError(f"guide must be true or false, not {guide!r}")
    if protocol is not None and protocol not in PROTOCOLS:  # (the selector sends one of them; a raw call may not)
        raise InputError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    length = number("max_length", max_length, int)
    return dataclasses.replace(
        DEFAULTS,
        guide=DEFAULTS.guide if guide is None else guide,
        use_cache=bool(use_cache),
        max_length=None if length == DEFAULTS.max_length else length,
        max_new_tokens=number("max_new_tokens", max_new_tokens, int),
        max_turns=number("max_turns", max_turns, int),
        temperature=number("temperature", temperature, float),
        seed=number("seed", seed, int),
        protocol=protocol,
    )


@dataclass(frozen=True)
class PageSettings:
    """The page's settings controls as it sends them, in the order its inputs list them (components/layout.py),
    built in one place from the values the page sends (components/wiring.py); checked when read (asked)."""

    use_cache: bool
    max_length: float | None  # (numbers as the fields send them: floats, or None where a field is empty)
    max_new_tokens: float | None
    max_turns: float | None
    temperature: float | None
    tools: Sequence[str] | None
    prompt: str | None = None
    seed: float | None = 0
    guide: bool | None = None  # None: the default
    protocol: str | None = None  # the Protocol selector: auto, textenv or chat (None: the default)

    def settings(self) -> Settings:
        """The engine Settings, or a clear InputError (make_settings)."""
        return make_settings(self.use_cache, self.max_length, self.max_new_tokens, self.max_turns, self.temperature,
                             self.seed, self.guide, self.protocol)

    def asked(self) -> TurnSettings:
        """What a job runs with: the settings, the checked tools and the prompt, or a clear InputError."""
        return TurnSettings(self.settings(), list(self.tools or []), clean_prompt(self.prompt))


def settings_from_dict(values: dict | None) -> TurnSettings:
    """API settings: any Settings field plus `tools` (list of names) and `prompt` (a system prompt template);
    unknown keys are errors, and so is a value of the wrong type (`"guide": "yes"`, `"use_cache": 1`). A max_length
    not given (or null) is None: the default for the backend (max_length_for)."""
    if values is not None and not isinstance(values, dict):
        raise InputError("settings must be a JSON object, e.g. {\"max_new_tokens\": 64}")
    values = dict(values or {})
    tools, prompt = values.pop("tools", None), values.pop("prompt", None)
    unknown = sorted(set(values) - set(SETTING_KEYS))
    if unknown:
        raise InputError(f"unknown setting(s) {', '.join(unknown)} (known: {', '.join(SETTING_KEYS)}, tools, prompt)")
    try:
        settings = dataclasses.replace(DEFAULTS, **{"max_length": None, **values})
    except TypeError as error:
        raise InputError(f"bad settings: {error}") from None
    for name in SETTING_KEYS:
        value = getattr(settings, name)
        if name in ("max_length", "protocol") and value is None:  # (not given)
            continue
        if name == "protocol":
            if not isinstance(value, str):
                raise InputError(f"setting protocol must be text (auto, textenv or chat), got {value!r}")
            continue
        expected = bool if name in FLAGS else (float if name in ("temperature", "top_p") else int)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            kind = "true or false" if expected is bool else expected.__name__
            raise InputError(f"setting {name} must be {kind}, got {value!r}")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, str) for t in tools)):
        raise InputError("setting tools must be a list of tool names")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError("setting prompt must be text (a system prompt; `{tools}` is replaced by the tool list)")
    return TurnSettings(settings, tools, None if prompt is None else clean_prompt(prompt))

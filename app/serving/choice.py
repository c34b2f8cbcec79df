"""What a caller asks a model job to run with (TurnSettings) and what serving chose for it (Job), plus the rule that
keeps one protocol's default prompt from being sent to the other."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from app.engine.engine import Engine
from app.settings import Settings


@dataclass(frozen=True)
class TurnSettings:
    """A job's settings as the page or the API sends them: engine Settings (checked against the model when chosen),
    tool names (None: every tool) and a prompt template (None: the protocol's default)."""

    settings: Settings
    tools: Sequence[str] | None = None
    prompt: str | None = None


@dataclass(frozen=True)
class Job:
    """TurnSettings chosen for this model (Service.choose): its engine, checked settings and prompt template."""

    engine: Engine
    settings: Settings
    prompt: str

    @property
    def protocol(self) -> str:
        return self.engine.protocol.name


def unedited(prompt: str | None, defaults: Collection[str]) -> bool:
    """Whether `prompt` is one of the protocols' default templates as shipped (line ends and surrounding blank space
    aside)."""
    def norm(text: str) -> str:
        return text.replace("\r\n", "\n").strip()

    return prompt is not None and norm(prompt) in {norm(d) for d in defaults}


def prompt_for_protocol(prompt: str | None, protocol_default: str, defaults: Collection[str]) -> str:
    """The prompt a protocol runs with: `prompt`, but where it is another protocol's default (unedited) or None,
    this protocol's default (`defaults`: every protocol's). So switching protocols never sends one protocol's
    default examples to the other, and an edited prompt is kept as written."""
    return protocol_default if prompt is None or unedited(prompt, defaults) else prompt

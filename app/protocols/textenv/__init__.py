"""TRL's TextEnvironment protocol, all of it: its markers and call parser (markers), few-shot prompt (prompt),
guide (grammar) and the Protocol they make (protocol)."""

from app.protocols.textenv.prompt import default_prompt_template
from app.protocols.textenv.protocol import TextEnvProtocol

__all__ = ["TextEnvProtocol", "default_prompt_template"]

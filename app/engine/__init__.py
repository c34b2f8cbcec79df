"""The engine: a chat turn is an episode of model segments with tool calls between them (UI-agnostic: typed events
out). Its face: Engine, Session, the comparisons, the prompt template and the rewards."""

from app.engine.comparisons import Comparison, GuideComparison, compare, compare_guide, forced_tokens, steered_tokens
from app.protocols.naming import PromptError
from app.protocols.textenv import default_prompt_template
from app.engine.rewards import builtin_questions, exact_match
from app.engine.session import Session
from app.engine.engine import Engine

__all__ = ["Engine", "Session", "Comparison", "GuideComparison", "compare", "compare_guide", "forced_tokens",
           "steered_tokens", "PromptError", "default_prompt_template", "builtin_questions", "exact_match"]

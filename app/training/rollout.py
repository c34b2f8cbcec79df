"""A rollout function for TRL's GRPOTrainer (`rollout_func=EngineRollout(...)`): every completion is a multi-turn tool
episode on this engine with its own KV cache; each prompt's group shares its prefilled prompt and question, and all rows
run in one batch. TRL's contract (docs/training.md): prompts come one per completion, each repeated `num_generations`
times in a row; the result holds `prompt_ids`, `completion_ids`, `logprobs` and `env_mask` (1 for the policy's tokens)
per completion, and other keys reach the reward functions."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from app.backends.local import LocalBackend
from app.engine.engine import Engine
from app.engine.groups import Group, open_group, run_groups
from app.episode import Episode
from app.settings import Settings
from app.tools.base import Tool
from app.training.weights import SYNC_MODES, sync

log = logging.getLogger(__name__)

MAX_TURNS = 32  # Settings' bound on tool calls per answer (TRL's max_tool_calling_iterations: None is unbounded)


def question_of(prompt) -> str:
    """The question in a TRL prompt: the text itself, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise ValueError("a conversational prompt needs a last user message with text content")
    return users[-1]["content"]


def runs(prompts: list) -> list[tuple[object, int]]:
    """Consecutive equal prompts as (prompt, how many): TRL's groups, repeated in a row by its sampler."""
    out: list[tuple[object, int]] = []
    for prompt in prompts:
        if out and out[-1][0] == prompt:
            out[-1] = (prompt, out[-1][1] + 1)
        else:
            out.append((prompt, 1))
    return out


@dataclass
class RolloutStats:
    """What the last call did: its seconds, rows, the tokens fed through the model, and the last weight sync."""

    seconds: float = 0.0
    rows: int = 0
    prefill_tokens: int = 0  # tokens fed as new input: the system prompt after a sync, group questions, tool
    # outputs, first tokens after forks
    generated_tokens: int = 0
    synced_step: int | None = None  # the trainer's global_step whose weights the engine holds
    sync_seconds: list[float] = field(default_factory=list)


class EngineRollout:
    """`rollout_func` for GRPOTrainer over a LocalBackend, called as TRL does: `rollout(prompts, trainer)`. `sync`: how
    the trainer's weights reach the engine at each new global_step ("float32" in place, the default; "int8" into a fresh
    model; None: never). `guide`: guided answers, off by default since a forced token is not the policy's."""

    def __init__(self, backend: LocalBackend, tools: dict[str, Tool] | None = None, protocol: str = "textenv",
                 prompt: str | None = None, sync: str | None = "float32", guide: bool = False, seed: int = 0):
        if sync is not None and sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {', '.join(SYNC_MODES)} or None (got {sync!r})")
        self.backend, self.tools, self.protocol, self.prompt = backend, tools, protocol, prompt
        self.sync_mode, self.guide, self.seed = sync, guide, seed
        self.engine = self._engine()
        self.stats = RolloutStats()
        self.calls = 0
        self.prompt_fed = False  # whether this engine's system prompt has been prefilled (by the last call)

    def _engine(self) -> Engine:
        """A new engine: its prefilled system prompt is computed from the backend's current weights."""
        return Engine(self.backend, tools=self.tools, prompt=self.prompt, protocol=self.protocol)

    def sync_weights(self, trainer) -> None:
        """Take the trainer's weights where its global_step moved since the last sync (the first call too)."""
        step = trainer.state.global_step
        if self.sync_mode is None or step == self.stats.synced_step:
            return
        policy = trainer.accelerator.unwrap_model(trainer.model)
        self.backend, seconds = sync(self.backend, policy, self.sync_mode)
        self.engine = self._engine()  # (the old prompt's keys/values came from the old weights)
        self.prompt_fed = False
        self.stats.synced_step = step
        self.stats.sync_seconds.append(seconds)

    def settings(self, trainer, prompt_tokens: int) -> Settings:
        """One group's settings from the trainer's: model and tool tokens fit in max_completion_length, as TRL's own
        tool loop bounds them."""
        budget = trainer.max_completion_length
        iterations = getattr(trainer, "max_tool_calling_iterations", MAX_TURNS)
        return Settings(max_new_tokens=min(budget, 4096), temperature=trainer.temperature, top_p=trainer.top_p,
                        top_k=getattr(trainer, "top_k", 0) or 0,
                        max_length=min(prompt_tokens + budget, self.engine.context_limit),
                        max_turns=min(iterations, MAX_TURNS), guide=self.guide, logprobs=True,
                        protocol=self.engine.protocol.name).validated(self.engine.context_limit)

    def check_trainer(self, trainer) -> None:
        """Refuse `mask_truncated_completions`, which would silently drop every row of a protocol whose finished answers
        end at its own marker rather than EOS."""
        if getattr(getattr(trainer, "args", None), "mask_truncated_completions", False) \
                and not self.engine.protocol.answer_ends_at_eos:
            raise ValueError(f"mask_truncated_completions would mask every {self.engine.protocol.name} completion "
                             "(its answers end at a marker, not at EOS): turn it off, or use the chat protocol")

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        self.check_trainer(trainer)
        self.sync_weights(trainer)
        began = time.perf_counter()
        groups: list[Group] = []
        seed = self.seed + self.calls * len(prompts)  # (different draws at every call)
        self.calls += 1
        for prompt, size in runs(prompts):
            group = open_group(self.engine, question_of(prompt), size,
                               Settings().validated(self.engine.context_limit), seed)
            group.settings = self.settings(trainer, len(group.prompt_ids))  # (its budget counts from the question)
            groups.append(group)
            seed += size
        episodes = [e for group in run_groups(self.engine, groups) for e in group]
        prefilled = sum(len(g.prompt_ids) - g.sessions[0].prompt_tokens for g in groups)  # (the questions)
        if not self.prompt_fed and groups:
            prefilled += groups[0].sessions[0].prompt_tokens  # (the first group prefilled the system prompt)
            self.prompt_fed = True
        prompt_ids = [group.prompt_ids for group in groups for _ in group.sessions]
        out = self.result(episodes, prompt_ids, eos=self.backend.tokenizer.eos_token_id)
        self.stats.seconds = time.perf_counter() - began
        self.stats.rows = len(episodes)
        self.stats.prefill_tokens = prefilled + sum(e.prefill_tokens or 0 for e in episodes)
        self.stats.generated_tokens = sum(s.generated_tokens for e in episodes for s in e.segments)
        return out

    @staticmethod
    def result(episodes: list[Episode], prompt_ids: list[list[int]], eos: int | None = None) -> dict[str, list]:
        """TRL's fields for each episode: its tokens after the question with their logprobs and env_mask, and what the
        reward functions read. An episode with no token after its question is given as the `eos` token with mask 0 and
        logprob 0.0, since TRL reads every completion's last token."""
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "answer",
                                                  "tool_calls", "tool_ok", "stop_reason", "answered")}
        for episode, ids in zip(episodes, prompt_ids, strict=True):
            after = episode.query_end - episode.query_start
            completion, logprobs, mask = episode.token_ids[after:], episode.logprobs[after:], episode.mask[after:]
            if not completion and eos is not None:
                completion, logprobs, mask = [eos], [0.0], [0]
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logprobs)
            out["env_mask"].append(mask)
            out["answer"].append(episode.answer)
            tools = [s for s in episode.segments if s.kind == "tool"]
            out["tool_calls"].append([[s.tool, s.query] for s in tools])
            out["tool_ok"].append([s.ok for s in tools])
            stop = episode.stop
            out["stop_reason"].append(stop.reason.value if stop is not None else "none")
            out["answered"].append(episode.answered)
        return out

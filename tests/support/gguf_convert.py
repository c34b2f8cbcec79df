"""A Hugging Face model folder as a GGUF file, written by llama.cpp's own conversion script (tests, benchmarks).

The script (convert_hf_to_gguf.py, with its gguf-py package) comes from the llama-cpp-python source distribution
the project builds llama-server from (scripts/build_llama_server.sh): downloaded once with pip into the cache
folder, unpacked there, never committed. llama.cpp's own writer, not one of ours, so that llama.cpp reads the file
as it reads any converted model (a hand-written exporter gave files llama.cpp ran many times slower).

The script reads a Qwen2 model's vocabulary through sentencepiece where the folder has a tokenizer.model, else as
a GPT-2 BPE vocabulary; it imports sentencepiece before it looks for the file. The project does not install
sentencepiece, so here the file is looked for first (FileNotFoundError: the script's own way to its BPE reader).
It names the BPE pre-tokenizer by a digest of how the tokenizer splits a test text, and refuses one it does not
know; the folders here carry the bundled SmolLM2 tokenizer (as saved by transformers 5, whose digest it does not
list), named "smollm" then, llama.cpp's name for it. Tests and benchmarks send token ids, not text.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from app.paths import cache_dir
from tests.support.llama_server import LLAMA_CPP_PYTHON_VERSION

# the converter in a child process: tokenizer.model looked for first, an unknown BPE digest named (see above)
_RUN = """
import runpy, sys
from conversion import base
sentencepiece = base.TextModel._create_vocab_sentencepiece
def looked_for_first(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return sentencepiece(self)
base.TextModel._create_vocab_sentencepiece = looked_for_first
named = base.TextModel.get_vocab_base_pre
def smollm_where_unknown(self, tokenizer):
    try:
        return named(self, tokenizer)
    except NotImplementedError:
        return "smollm"
base.TextModel.get_vocab_base_pre = smollm_where_unknown
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_dir() -> Path:
    """llama.cpp's tree holding convert_hf_to_gguf.py and gguf-py, unpacked once into the cache folder."""
    dest = cache_dir() / f"llama-convert-{LLAMA_CPP_PYTHON_VERSION}"
    if (dest / "convert_hf_to_gguf.py").exists():
        return dest
    inner = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", work,
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], check=True, timeout=600)
        part = dest.with_name(dest.name + f".tmp{os.getpid()}")
        with tarfile.open(Path(work) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz") as tar:
            wanted = [m for m in tar.getmembers() if m.name.startswith(inner) and (
                m.name[len(inner):] == "convert_hf_to_gguf.py"
                or m.name[len(inner):].split("/")[0] in ("gguf-py", "conversion"))]
            for member in wanted:
                member.name = member.name[len(inner):]
            tar.extractall(part, members=wanted, filter="data")
        try:
            part.rename(dest)
        except OSError:  # another process unpacked it first
            subprocess.run(["rm", "-rf", str(part)], check=False)
    return dest


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """Write `folder`'s model (config, safetensors, tokenizer) as the GGUF file `out` (`outtype`: f32, f16,
    q8_0, ... as the script takes them)."""
    tree = converter_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    subprocess.run([sys.executable, "-c", _RUN, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                    str(out), "--outtype", outtype], check=True, env=env, capture_output=True, text=True,
                   timeout=1800)
    return out

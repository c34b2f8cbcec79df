"""How a handler meets Gradio: its inputs arrive as named arguments, the settings controls as one PageSettings, and
each update it returns or yields (a frozen dataclass whose fields are named for components) goes back as
{component: value} for the fields it sets, so a handler never pads its outputs."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gradio as gr
from gradio.components import Component

from app.serving import closes_elsewhere
from components.inputs import PageSettings


def as_outputs(update: Any, outputs: Mapping[str, Component]) -> dict[Component, Any]:
    """{component: value} for each field of `update` that is not None (None: the component stays as it is)."""
    return {outputs[f.name]: value for f in dataclasses.fields(update)
            if (value := getattr(update, f.name)) is not None}


def page_event(handler: Callable, outputs: Mapping[str, Component], inputs: Mapping[str, Component] | None = None,
               settings: Mapping[str, Component] | None = None) -> dict:
    """The fn, inputs and outputs of a Gradio event for `handler(**inputs, [settings=PageSettings], request=…)`:
    the inputs go as a set (Gradio hands them over as one {component: value} dict), named back by `inputs`' keys;
    `settings`, the settings controls by PageSettings field, become one PageSettings."""
    inputs, settings = dict(inputs or {}), dict(settings or {})
    named = {component: name for name, component in inputs.items()}
    fields = {component: name for name, component in settings.items()}

    def arguments(values: dict) -> dict:
        kwargs = {named[c]: v for c, v in values.items() if c in named}
        if settings:
            kwargs["settings"] = PageSettings(**{fields[c]: v for c, v in values.items() if c in fields})
        return kwargs

    if inspect.isgeneratorfunction(handler):
        def each(values: dict | None, request: gr.Request) -> Iterator[dict]:
            for update in handler(**arguments(values or {}), request=request):
                yield as_outputs(update, outputs)
    else:
        def each(values: dict | None, request: gr.Request) -> dict:
            return as_outputs(handler(**arguments(values or {}), request=request), outputs)

    if inputs or settings:
        fn = each
    else:
        def fn(request: gr.Request) -> Any:
            return each(None, request)
    if inspect.isgeneratorfunction(handler):  # (closed off Gradio's event loop when the client goes away)
        fn = closes_elsewhere(fn)
    return dict(fn=fn, inputs=set(inputs.values()) | set(settings.values()) or None, outputs=list(outputs.values()))

"""The Blocks layout and its wiring: chat, controls, token view, settings, stats, examples, API endpoints."""

from __future__ import annotations

import gradio as gr

from app.backends import concurrent_turns
from app.engine import default_prompt_template
from app.paths import ASSETS
from app.settings import PROTOCOLS
from app.serving import closes_elsewhere
from components.batch import MAX_BATCH, empty_frame
from components.inputs import DEFAULTS, page_protocol, tool_names
from components.page import Page
from components.status import finished_marker
from components.timing import COLOR_MAP as TIMING_COLORS
from components.timing import prefill_frame, time_frame, timing_summary
from components.tokens import COLOR_MAP
from components.wiring import page_event

MODEL = "model"  # the one concurrency group of every event that runs the model
QUEUE_MAX_SIZE = 32
EXAMPLES = ["What is 41 * 23?", "What does kludge mean?", "Hello, who are you?"]


def launch_kwargs() -> dict:
    """Public-Space launch settings; host and port come from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT."""
    return {
        "share": False,
        "enable_monitoring": False,
        "theme": gr.themes.Soft(),
        "css": (ASSETS / "style.css").read_text(encoding="utf-8"),
        "footer_links": ["api", "gradio"],
    }


def completion_marker(elem_id: str) -> gr.HTML:
    """A completion marker (components.status.finished_marker), starting at 0 finished: in the page's DOM for the
    browser tests to read, and hidden from the visitor ("hidden": no space in the layout, unlike False, which
    leaves it out of the DOM)."""
    return gr.HTML(finished_marker(0), elem_id=elem_id, visible="hidden", js_on_load=None)


def build_demo(page: Page | None = None) -> gr.Blocks:
    page = page if page is not None else Page()
    turns = concurrent_turns()  # turns (and Compare, Batch, API calls) that run at once (app.backends.select)
    # (delete_cache: the Batch tab's downloads, in Gradio's cache folder, go after an hour, checked hourly)
    with gr.Blocks(title="TextEnv Chat", delete_cache=(3600, 3600)) as demo:
        gr.Markdown("# TextEnv Chat\nA small model that calls tools (calculator, Jargon File search) "
                    "through `<request><Tool>query<call>` … `<response>` (protocol textenv) or its chat template's "
                    "`<tool_call>` JSON (protocol chat); each segment shows why it stopped.")
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Tabs():
                    with gr.Tab("Chat", id="chat-tab"):
                        chat = gr.Chatbot(elem_id="chat", label="Chat", height=640, group_consecutive_messages=False,
                                          latex_delimiters=[], feedback_options=None, allow_tags=False)
                        msg = gr.Textbox(elem_id="msg", label="Message", placeholder="Ask something…", lines=1,
                                         max_lines=6, submit_btn=False)
                        with gr.Row():
                            send = gr.Button("Send", elem_id="send", variant="primary")
                            stop = gr.Button("Stop", elem_id="stop", variant="stop")
                            new_chat = gr.Button("New chat", elem_id="new-chat")
                        with gr.Row():  # (in a row of five, "Compare cache" breaks over two lines)
                            compare = gr.Button("Compare cache", elem_id="compare", size="md")
                            compare_guide = gr.Button("Compare guide", elem_id="compare-guide", size="md")
                        status = gr.Markdown("ready", elem_id="status")
                        turn_marker = completion_marker("turn-marker")
                        gr.Examples(EXAMPLES, inputs=[msg], label="Examples", api_visibility="private")
                        compare_result = gr.Markdown(
                            "*Compare cache runs the message with the KV cache on and off from this point of the "
                            "chat (an empty box: the chat's last turn again), without changing the chat; Compare "
                            "guide runs it with the guide on and off: what the guide chose, and what the model "
                            "writes alone.*",
                            elem_id="compare-result")
                        with gr.Row():
                            timing = gr.BarPlot(prefill_frame([]), x="segment", y="tokens", color="part",
                                                color_map=TIMING_COLORS, title="Prefill per segment: new vs reused",
                                                x_title="turn.segment", y_title="tokens", tooltip="all",
                                                x_label_angle=-40, elem_id="timing", height=300)
                            timing_ms = gr.BarPlot(time_frame([]), x="segment", y="ms", color="kind",
                                                   title="Time per segment", x_title="turn.segment", y_title="ms",
                                                   tooltip="all", x_label_angle=-40, elem_id="timing-ms", height=300)
                        timing_text = gr.Markdown(timing_summary([]), elem_id="timing-summary")
                    with gr.Tab("Batch", id="batch-tab", elem_id="batch-tab"):
                        gr.Markdown(f"One question per line, optionally `question | expected answer` (at most "
                                    f"{MAX_BATCH}). The batch runs with the settings, tools and system prompt "
                                    "on the right, twice: KV cache on, then off. A reward is 1 when the answer "
                                    "after `Result =` is exactly the expected one (thousands separators aside), "
                                    "as in TRL's exact-match reward. **Download episodes** gives the cache-on "
                                    "run's episodes as JSONL, one a line: question, token_ids, mask (0 for the "
                                    "tokens the guide forced), provenance, reward and protocol, as a TRL trainer "
                                    "takes them.")
                        batch_questions = gr.Textbox(elem_id="batch-questions", label="Questions", lines=6,
                                                     max_lines=20, placeholder="What is 41 * 23? | 943")
                        with gr.Row():
                            batch_load = gr.Button("Load the built-in set", elem_id="batch-load")
                            batch_run = gr.Button("Run batch", elem_id="batch-run", variant="primary")
                            batch_stop = gr.Button("Stop", elem_id="batch-stop", variant="stop")
                        batch_status = gr.Markdown("ready", elem_id="batch-status")
                        batch_marker = completion_marker("batch-marker")
                        batch_summary = gr.Markdown("", elem_id="batch-summary")
                        batch_results = gr.Dataframe(empty_frame(), elem_id="batch-results", label="Per query",
                                                     interactive=False, wrap=True,
                                                     column_widths=["4%", "17%", "22%", "17%", "14%", "16%", "10%"])
                        # the cache-on pass's episodes, one JSON object a line: question, token_ids, mask,
                        # provenance, reward (what a TRL trainer is fed); offered once a batch has run
                        batch_download = gr.DownloadButton("Download episodes (JSONL)", elem_id="batch-download",
                                                           interactive=False, size="md")
            with gr.Column(scale=2):
                with gr.Accordion("Settings", open=True):
                    use_cache = gr.Checkbox(DEFAULTS.use_cache, label="KV cache", elem_id="use-cache")
                    guide = gr.Checkbox(DEFAULTS.guide, label="Guided answers", elem_id="guide",
                                        info="A grammar keeps each segment to the protocol and opens the answer "
                                             "with the tool's result; the tokens it chose show as \"guide\".")
                    protocol = gr.Radio(list(PROTOCOLS), value=page_protocol(), label="Protocol", elem_id="protocol",
                                        info="How model and tools talk: textenv (TRL's TextEnvironment markers, "
                                             "a few-shot prompt), chat (the model's chat template with its tools, "
                                             "<tool_call> JSON), or auto (chat where the model's own template "
                                             "lists tools, else textenv). The status line says which answered; a "
                                             "change starts a new chat.")
                    max_length = gr.Number(DEFAULTS.max_length, label="max_length (whole session, tokens)",
                                           elem_id="max-length", step=1)
                    max_new_tokens = gr.Number(DEFAULTS.max_new_tokens, label="max_new_tokens (per segment)",
                                               elem_id="max-new-tokens", step=1)
                    max_turns = gr.Number(DEFAULTS.max_turns, label="max_turns (tool calls per answer)",
                                          elem_id="max-turns", step=1)
                    temperature = gr.Slider(0, 2, value=DEFAULTS.temperature, step=0.05,
                                            label="temperature (0 = greedy)", elem_id="temperature")
                    seed = gr.Number(DEFAULTS.seed, label="seed (sampling: a new chat starts from it, so the same "
                                                          "seed gives the same answers)", elem_id="seed", step=1,
                                     minimum=0)
                    names = tool_names()
                    tools = gr.CheckboxGroup(names, value=names, label="Tools", elem_id="tools")
                    prompt = gr.Textbox(default_prompt_template(), elem_id="system-prompt", lines=3, max_lines=8,
                                        label="System prompt ({tools} is replaced by the checked tools, one per "
                                              "line, {abilities} and {actions} by their words in a greeting; an "
                                              "example line ending in <call> gets the tool's real output and "
                                              "answer; a change starts a new chat)",
                                        info="Each protocol has its own default: textenv's few-shot lines, or "
                                             "chat's system paragraph and examples (`Q: question`, then `A: answer`"
                                             " or `> tool: argument`). Switching the protocol swaps the default "
                                             "for the other's; an edited prompt stays as written, and one that "
                                             "does not fit the protocol's format is an error on the status line.")
                stats = gr.Markdown(page.chat.stats(None), elem_id="stats")
                tokens = gr.HighlightedText(label="Tokens (system · user · model · guide · tool)", elem_id="tokens",
                                            color_map=COLOR_MAP, show_legend=True, combine_adjacent=False,
                                            show_inline_category=False)

        # What the page hands queued work when it is submitted: a sent message with its Stop ticket, and the
        # tickets of Compare and Batch (hidden: their values travel with each queued event)
        submitted = gr.JSON(visible=False)
        compare_ticket, batch_ticket = gr.Number(visible=False), gr.Number(visible=False)
        # the settings controls by PageSettings field: each handler gets them as one PageSettings
        settings = dict(use_cache=use_cache, max_length=max_length, max_new_tokens=max_new_tokens,
                        max_turns=max_turns, temperature=temperature, tools=tools, prompt=prompt, seed=seed,
                        guide=guide, protocol=protocol)
        chat_view = dict(chat=chat, msg=msg, status=status, tokens=tokens, stats=stats, turn_marker=turn_marker,
                         timing=timing, timing_ms=timing_ms, timing_text=timing_text)
        compare_view = dict(compare_result=compare_result, status=status, turn_marker=turn_marker)
        batch_view = dict(batch_results=batch_results, batch_summary=batch_summary, batch_status=batch_status,
                          batch_download=batch_download, batch_marker=batch_marker)
        running = dict(concurrency_id=MODEL, concurrency_limit=turns, show_progress="hidden",
                       api_visibility="private")
        # a message sent while a turn runs queues behind it ("multiple": Gradio's default "once" drops it silently)
        turn = dict(**page_event(page.chat.turn, chat_view, dict(submitted=submitted), settings), **running,
                    trigger_mode="multiple")
        # Submitting (the message box emptied, Stop tickets taken) and Stop must not wait behind running work:
        # their own group, no limit. A ticket lets Stop cancel work still waiting in the queue.
        quick = dict(concurrency_id="stop", concurrency_limit=None, show_progress="hidden", api_visibility="private")
        send.click(page.chat.submit, [msg, chat], [msg, submitted, chat], **quick, api_name="ui_send").then(
            **turn, api_name="ui_turn")
        msg.submit(page.chat.submit, [msg, chat], [msg, submitted, chat], **quick, api_name="ui_enter").then(
            **turn, api_name="ui_submit")
        stop.click(page.chat.stop, **quick, api_name="ui_stop")
        batch_stop.click(page.batch.stop, **quick, api_name="ui_batch_stop")
        fresh = dict(**page_event(page.chat.new_chat, chat_view), concurrency_id="new-chat", concurrency_limit=None,
                     show_progress="hidden", api_visibility="private")
        new_chat.click(**fresh, api_name="ui_new_chat")
        # the chat's own trash icon is New chat too: else it would empty the view only, and the next answer would
        # bring the "cleared" turns back (the session still holds them)
        chat.clear(**fresh, api_name="ui_clear_chat")
        for button, handler, name in ((compare, page.chat.compare, "ui_compare"),
                                      (compare_guide, page.chat.compare_guide, "ui_compare_guide")):
            button.click(page.chat.ticket, None, compare_ticket, **quick, api_name=f"{name}_ticket").then(
                **page_event(handler, compare_view, dict(msg=msg, ticket=compare_ticket), settings), **running,
                api_name=name)
        batch_load.click(page.batch.builtin_batch, None, [batch_questions], concurrency_id="batch-load",
                         concurrency_limit=None, show_progress="hidden", api_visibility="private",
                         api_name="ui_batch_load")
        batch_run.click(page.batch.ticket, None, batch_ticket, **quick, api_name="ui_batch_ticket").then(
            **page_event(page.batch.run, batch_view, dict(batch_questions=batch_questions, ticket=batch_ticket),
                         settings), **running, api_name="ui_batch")
        # the prompt box follows the protocol while it holds a default (SettingsPanel.protocol_prompt)
        settings_view = dict(max_length=max_length, prompt=prompt)
        protocol.change(**page_event(page.settings.protocol_prompt, settings_view,
                                     dict(protocol=protocol, prompt=prompt)),
                        concurrency_id="protocol", concurrency_limit=None, show_progress="hidden",
                        api_visibility="private", api_name="ui_protocol")
        load = dict(concurrency_id="load", concurrency_limit=None, show_progress="hidden", api_visibility="private")
        demo.load(**page_event(page.chat.refresh, chat_view), **load, api_name="ui_load").then(
            **page_event(page.settings.on_load, settings_view), **load, api_name="ui_settings_load")
        demo.unload(page.chat.unload)

        gr.api(closes_elsewhere(page.api.chat), api_name="chat", concurrency_id=MODEL, concurrency_limit=turns)
        gr.api(page.api.ask, api_name="ask", concurrency_id=MODEL, concurrency_limit=turns)
        gr.api(page.api.stats, api_name="stats", concurrency_id="stats", concurrency_limit=None)
    demo.queue(max_size=QUEUE_MAX_SIZE, default_concurrency_limit=1)
    return demo

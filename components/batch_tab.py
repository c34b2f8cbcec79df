"""The Batch tab's handlers: a list of questions run as one batch episode, with the cache on and then off (a mixin of
components.handlers.ChatService, whose engines, sessions and KV budget they use, as components.api's are); its
episodes offered as a JSONL download."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr
from gradio.utils import get_upload_folder

from app.engine import builtin_questions
from app.episode import Episode, EpisodeFinished
from components.batch import (BatchRun, batch_frame, batch_summary, empty_frame, format_items, parse_batch, rewards,
                              write_episodes)
from components.inputs import PageSettings
from components.status import failure_status, finished_marker, protocol_note

if TYPE_CHECKING:
    from app.serving import SessionStore


class BatchTab:
    """The Batch tab's Run, Stop and built-in questions, for ChatService."""

    store: SessionStore

    def batch_ticket(self, request: gr.Request) -> int:
        return self.store.get(request.session_hash).batch_stop.ticket()

    @staticmethod
    def builtin_batch() -> str:
        return format_items(builtin_questions())

    def batch(self, text: str, use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt,
              request: gr.Request, seed=0, guide: bool | None = None, protocol: str | None = None,
              ticket: int | None = None) -> Iterator[tuple]:
        """Run the lines as one batch episode twice (cache on, then off). Yields (rows, summary, status, download,
        marker): the download, once the batch ends, is the cache-on pass's episodes as JSONL (components.batch.
        episode_record); the completion marker comes with the final status (done or error) only."""
        page = PageSettings(use_cache, max_length, max_new_tokens, max_turns, temperature, tools, prompt, seed, guide,
                            protocol)
        entry = self.store.get(request.session_hash)
        state = self.page_of(entry)
        cancel = entry.batch_stop.begin(ticket)

        def ended(*outputs) -> tuple:
            """The run's last update: its outputs, and the marker of one more finished batch."""
            return (*outputs, finished_marker(state.batch_finished.bump()))

        try:  # (checked before the table is emptied: a rejected batch leaves the last results shown)
            items = parse_batch(text)
            engine, settings = self.page_settings(page)
            prompt = self._page_prompt(engine, page)
        except Exception as error:  # handler boundary
            yield ended(gr.skip(), gr.skip(), failure_status(error, "batch", request.session_hash), gr.skip())
            return
        yield empty_frame(), "", "running", gr.DownloadButton(value=None, interactive=False), gr.skip()
        try:
            questions = [item.question for item in items]
            runs: list[BatchRun] = []
            for cached in (True, False):
                mode = "on" if cached else "off"
                values = dataclasses.replace(settings, use_cache=cached)
                finished: dict[int, Episode] = {}
                with self.job_slot(engine.new_session(prompt), cancel, use_cache=cached, rows=len(questions)):
                    began = time.perf_counter()  # (after any wait for the budget)
                    for event in engine.stream_batch(questions, values, prompt, cancel=cancel):  # rows at once
                        if isinstance(event, EpisodeFinished):
                            finished[event.row] = event.episode
                            yield (gr.skip(), gr.skip(), f"running: cache {mode}, {len(finished)}/{len(items)} done",
                                   gr.skip(), gr.skip())
                episodes = [finished[row] for row in range(len(finished)) if row in finished]  # rows 0.. in order
                runs.append(BatchRun(episodes, time.perf_counter() - began, cached, stopped=cancel.is_set()))
                if cached:  # show the rows as soon as the first pass is done
                    yield (batch_frame(episodes, items), batch_summary(items, runs[0]), "running: cache off",
                           gr.skip(), gr.skip())
                if cancel.is_set():
                    break
            on, off = runs[0], (runs[1] if len(runs) > 1 else None)
            for episode, score in zip(on.episodes, rewards(on.episodes, items)):
                episode.reward = score
            status = " · ".join(["done" if not cancel.is_set() else "done (stopped by user)",
                                 protocol_note(engine.protocol.name)])
            yield ended(batch_frame(on.episodes, items), batch_summary(items, on, off), status, episodes_download(on))
        except Exception as error:  # handler boundary
            yield ended(gr.skip(), gr.skip(), failure_status(error, "batch", request.session_hash), gr.skip())

    def stop_batch(self, request: gr.Request) -> None:
        self.store.cancel(request.session_hash, "batch")


def episodes_download(run: BatchRun) -> gr.DownloadButton:
    """The Download button holding `run`'s episodes as JSONL, in a folder of this request's own inside Gradio's
    cache folder (served from there, deleted with the page's delete_cache), named by 128 random bits (secrets), so
    no other visitor's batch shares it or can guess its address."""
    folder = Path(get_upload_folder()) / f"textenv-batch-{secrets.token_hex(16)}"
    folder.mkdir(mode=0o700, parents=True)
    return gr.DownloadButton(value=str(write_episodes(run.episodes, folder)), interactive=True)

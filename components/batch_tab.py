"""The Batch tab's handlers: a list of questions run as one batch episode, with the cache on and then off, on the
process's Service (its engines, KV budget and batched steps); its episodes offered as a JSONL download. Handlers
yield BatchView updates: a field left None leaves its component as it is."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.utils import get_upload_folder

from app.engine import builtin_questions
from app.episode import Episode, EpisodeFinished
from app.serving import Admitted, Service
from components.batch import (BatchRun, batch_frame, batch_summary, empty_frame, format_items, parse_batch, rewards,
                              write_episodes)
from components.inputs import PageSettings
from components.page_state import PageStates
from components.status import failure_status, finished_marker, protocol_note


@dataclass(frozen=True)
class BatchView:
    """One update of the Batch tab's outputs; None: unchanged."""

    batch_results: Any = None
    batch_summary: str | None = None
    batch_status: str | None = None
    batch_download: Any = None
    batch_marker: str | None = None  # the completion marker, with a final status


class BatchTab:
    """The Batch tab's Run, Stop and built-in questions."""

    def __init__(self, service: Service, pages: PageStates):
        self.service, self.pages = service, pages

    def ticket(self, request: gr.Request) -> int:
        return self.service.store.get(request.session_hash).batch_stop.ticket()

    @staticmethod
    def builtin_batch() -> str:
        return format_items(builtin_questions())

    def run(self, batch_questions: str, settings: PageSettings, request: gr.Request,
            ticket: int | None = None) -> Iterator[BatchView]:
        """Run the lines as one batch episode twice (cache on, then off). The download, once the batch ends, is the
        cache-on pass's episodes as JSONL (components.batch.episode_record); the completion marker comes with the
        final status (done or error) only."""
        key = request.session_hash
        entry = self.service.store.get(key)
        state = self.pages.of(entry)
        cancel = entry.batch_stop.begin(ticket)

        def ended(**shown) -> BatchView:
            """The run's last update, with the marker of one more finished batch."""
            return BatchView(**shown, batch_marker=finished_marker(state.batch_finished.bump()))

        try:  # (checked before the table is emptied: a rejected batch leaves the last results shown)
            items = parse_batch(batch_questions)
            job = self.service.choose(settings.asked())
        except Exception as error:  # handler boundary
            yield ended(batch_status=failure_status(error, "batch", key))
            return
        yield BatchView(empty_frame(), "", "running", gr.DownloadButton(value=None, interactive=False))
        try:
            questions = [item.question for item in items]
            runs: list[BatchRun] = []
            for cached in (True, False):
                mode = "on" if cached else "off"
                pass_job = dataclasses.replace(job, settings=dataclasses.replace(job.settings, use_cache=cached))
                finished: dict[int, Episode] = {}
                began = time.perf_counter()
                for event in self.service.stream_batch(pass_job, questions, cancel):  # rows at once
                    if isinstance(event, Admitted):  # (timed from here: after any wait for the budget)
                        began = time.perf_counter()
                    elif isinstance(event, EpisodeFinished):
                        finished[event.row] = event.episode
                        yield BatchView(batch_status=f"running: cache {mode}, {len(finished)}/{len(items)} done")
                episodes = [finished[row] for row in range(len(finished)) if row in finished]  # rows 0.. in order
                runs.append(BatchRun(episodes, time.perf_counter() - began, cached, stopped=cancel.is_set()))
                if cached:  # show the rows as soon as the first pass is done
                    yield BatchView(batch_frame(episodes, items), batch_summary(items, runs[0]), "running: cache off")
                if cancel.is_set():
                    break
            on, off = runs[0], (runs[1] if len(runs) > 1 else None)
            for episode, score in zip(on.episodes, rewards(on.episodes, items)):
                episode.reward = score
            status = " · ".join(["done" if not cancel.is_set() else "done (stopped by user)",
                                 protocol_note(job.protocol)])
            yield ended(batch_results=batch_frame(on.episodes, items), batch_summary=batch_summary(items, on, off),
                        batch_status=status, batch_download=episodes_download(on))
        except Exception as error:  # handler boundary
            yield ended(batch_status=failure_status(error, "batch", key))

    def stop(self, request: gr.Request) -> None:
        self.service.store.cancel(request.session_hash, "batch")


def episodes_download(run: BatchRun) -> gr.DownloadButton:
    """The Download button holding `run`'s episodes as JSONL, in a folder of this request's own inside Gradio's
    cache folder (served from there, deleted with the page's delete_cache), named by 128 random bits (secrets), so
    no other visitor's batch shares it or can guess its address."""
    folder = Path(get_upload_folder()) / f"textenv-batch-{secrets.token_hex(16)}"
    folder.mkdir(mode=0o700, parents=True)
    return gr.DownloadButton(value=str(write_episodes(run.episodes, folder)), interactive=True)

"""TextEnv Chat web app: `python app.py` (host/port from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).

The UI lives in components/ (this file only builds and launches it; `import app` is the package app/).
"""

from __future__ import annotations

import gc
import logging
import os

from app.backends import BackendError
from app.serving import Service
from components.layout import build_demo, launch_kwargs
from components.page import Page


def main() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"))
    service = Service()
    service.store.start_sweeper()  # idle sessions go even when no visitor comes
    if os.environ.get("WARM_UP", "1") != "0":
        try:
            service.warm_up()  # load the model and prefill the system prompt before the first visitor
        except BackendError as error:  # a model server that is down: the page says so and each turn asks again
            logging.getLogger(__name__).error("%s", error)
        except Exception:  # (the warm-up is for speed only: the page still starts, and each turn reports its own)
            logging.getLogger(__name__).exception("the warm-up turn failed")
    demo = build_demo(Page(service))
    # What is alive now (model, page, vocabulary, grammar tables) lives as long as the server: freezing it keeps it
    # out of the cyclic collector's full passes, which stall whichever thread runs them, often the model's scheduler
    # (docs/concurrency.md). Collected first, so no garbage is frozen; later objects are collected as usual.
    gc.collect()
    gc.freeze()
    demo.launch(**launch_kwargs())


if __name__ == "__main__":
    main()

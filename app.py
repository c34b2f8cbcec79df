"""TextEnv Chat web app: `python app.py` (host/port from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).

The UI lives in components/ (this file only builds and launches it; `import app` is the package app/).
"""

from __future__ import annotations

import gc
import logging
import os

from app.backends import BackendError
from components.handlers import ChatService
from components.layout import build_demo, launch_kwargs


def main() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"))
    service = ChatService()
    service.store.start_sweeper()  # idle sessions go even when no visitor comes
    if os.environ.get("WARM_UP", "1") != "0":
        try:
            service.warm_up()  # load the model and prefill the system prompt before the first visitor
        except BackendError as error:  # a model server that is down: the page says so and each turn asks again
            logging.getLogger(__name__).error("%s", error)
        except Exception:  # (the warm-up is for speed only: the page still starts, and each turn reports its own)
            logging.getLogger(__name__).exception("the warm-up turn failed")
    demo = build_demo(service)
    # What is alive now lives as long as the server (the model, the page, the tokenizer's vocabulary, the answer
    # grammar's tables: ~460,000 objects; with WARM_UP=0 the model loads later): out of the cyclic collector's
    # scans, whose full passes took ~200 ms in whichever thread set them off, often the model's scheduler, every
    # visitor's row waiting (8 chats at once, 6 rounds: 229 ms of collections against 11 ms frozen). Collected
    # first, so no garbage is frozen with it; objects made later are collected as usual.
    gc.collect()
    gc.freeze()
    demo.launch(**launch_kwargs())


if __name__ == "__main__":
    main()

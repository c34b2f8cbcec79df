"""TextEnv Chat web app: `python app.py` (host/port from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).

The UI lives in components/ (this file only builds and launches it; `import app` is the package app/).
"""

from __future__ import annotations

import gc
import logging
import os

from app.backend import BackendError
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
    demo = build_demo(service)
    # What is alive now lives as long as the server (the model, the page, the tokenizer's vocabulary, the answer
    # grammar's tables: ~460,000 objects): out of the cyclic collector's scans, whose full passes took ~200 ms in
    # whichever thread set them off, often the model's scheduler, every visitor's row waiting (8 chats at once,
    # 6 rounds: 229 ms of collections against 11 ms frozen). Objects made later are collected as usual.
    gc.freeze()
    demo.launch(**launch_kwargs())


if __name__ == "__main__":
    main()

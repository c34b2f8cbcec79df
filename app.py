"""TextEnv Chat web app: `python app.py` (host/port from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).

The UI lives in components/ (this file only builds and launches it; `import app` is the package app/).
"""

from __future__ import annotations

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
    demo.launch(**launch_kwargs())


if __name__ == "__main__":
    main()

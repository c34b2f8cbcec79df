"""The page's handlers over one Service: the Chat tab, the Batch tab, the settings fields and the API, sharing each
visitor's page state (components/page_state.py)."""

from __future__ import annotations

from app.serving import Service
from components.api import Api
from components.batch_tab import BatchTab
from components.chat_tab import ChatTab, SettingsPanel
from components.page_state import PageState, PageStates


class Page:
    """What components/layout.py wires: each part holds the service; none of them is one."""

    def __init__(self, service: Service | None = None):
        self.service = service if service is not None else Service()
        self.pages = PageStates()
        self.chat = ChatTab(self.service, self.pages)
        self.batch = BatchTab(self.service, self.pages)
        self.settings = SettingsPanel(self.service)
        self.api = Api(self.service, self.pages)

    def page_state(self, key: str) -> PageState | None:
        """The page state of the visitor `key`, if they have one (nothing is created or marked used)."""
        return self.pages.peek(self.service.store.peek(key))

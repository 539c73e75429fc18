"""An asyncio loop on a thread, called as a function: the enrolment tests read as steps
(``loop(enrol.enrol(url, token))``) while the backbone runs on its own loop."""

from __future__ import annotations

from kvasir_bus.loopthread import LoopThread


class Loop(LoopThread):
    def __init__(self) -> None:
        super().__init__("test-enrol")

    def __call__(self, coro, timeout: float = 60):
        return self.run(coro, timeout)

    def close(self) -> None:
        self.stop()

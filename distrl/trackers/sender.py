"""A started tracker fed by a thread of its own, so that the driver never waits for a tracking service: a step's
row is queued in microseconds, and a slow or dead server (MLflow retries a request for minutes) delays only the
thread. Rows are sent in step order; the first failure stops the thread and is kept for the driver to report."""

from __future__ import annotations

import queue
import threading

from distrl.trackers.base import Tracker


class Sender:
    """`send(step, row)` queues a row for `tracker.log`; `stop(timeout)` sends what is queued and ends the thread.
    `failure` is (step, error) of the row whose log raised (nothing is sent after it)."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.failure: tuple[int, Exception] | None = None
        self._rows: queue.SimpleQueue[tuple[int, dict[str, float | None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_rows, name=f"distrl-tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def _send_rows(self) -> None:
        while (item := self._rows.get()) is not None:
            step, row = item
            try:
                self.tracker.log(step, row)
            except Exception as err:  # noqa: BLE001 - kept for the driver, which names it and drops the tracker
                self.failure = (step, err)
                return

    def send(self, step: int, row: dict[str, float | None]) -> None:
        self._rows.put((step, dict(row)))

    def stop(self, timeout: float) -> bool:
        """Send the queued rows, then end the thread; False if it was still sending after `timeout` seconds (a
        daemon thread: it does not keep the process alive)."""
        self._rows.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

"""JobQueue: one background thread running jobs in submission order.

Jobs are numbered; callers wait for a number (every job up to it is then done). Order is
what keeps tier slots consistent: the scheduler's ops for a slot run in the order it
issued them. A job must not raise (it records its own failures); if it does, the error
is logged and the queue goes on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class JobQueue:
    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> int:
        with self._cond:
            if self._closed:
                raise RuntimeError("job queue is closed")
            self._jobs.append(job)
            self._submitted += 1
            self._cond.notify_all()
            return self._submitted

    def is_done(self, seq: int) -> bool:
        with self._cond:
            return self._done >= seq

    def wait(self, seq: int, timeout: float | None = None) -> bool:
        """Wait until job `seq` (and every earlier one) ran; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= seq, timeout)

    def drain(self) -> None:
        with self._cond:
            seq = self._submitted
        self.wait(seq)

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception:
                logger.exception("offload background job failed")
            with self._cond:
                self._done += 1
                self._cond.notify_all()

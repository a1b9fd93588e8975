"""KVOutputAggregator: one place where per-worker connector results become one (invariant 3).

A request counts as finished sending (or receiving) once the expected number of workers
reported it. Failures are unioned, and a failed receive is held until the same request
completes its quorum, so the scheduler sees failure and completion together.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from kvferry.connector.output import KVConnectorOutput

logger = logging.getLogger(__name__)


class KVOutputAggregator:
    def __init__(self, expected_finished_count: int):
        assert expected_finished_count >= 1
        self.expected = expected_finished_count
        self._remaining_send: dict[str, int] = defaultdict(lambda: self.expected)
        self._remaining_recv: dict[str, int] = defaultdict(lambda: self.expected)
        self._failed_recv: set[str] = set()

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        present = [o for o in outputs if o is not None]
        if not present:
            return None
        result = KVConnectorOutput()
        for out in present:
            result.finished_sending |= self._count(self._remaining_send, out.finished_sending)
            result.finished_recving |= self._count(self._remaining_recv, out.finished_recving)
            self._failed_recv |= out.failed_recving
            result.invalid_block_ids |= out.invalid_block_ids
            result.events.extend(out.events)
            if out.stats is not None:
                result.stats = out.stats if result.stats is None else result.stats.aggregate(out.stats)
        # Release held failures together with the completion of their request.
        result.failed_recving = self._failed_recv & result.finished_recving
        self._failed_recv -= result.failed_recving
        return result

    def _count(self, remaining: dict[str, int], reported: set[str]) -> set[str]:
        done = set()
        for req_id in reported:
            remaining[req_id] -= 1
            if remaining[req_id] == 0:
                del remaining[req_id]
                done.add(req_id)
        return done

    @property
    def pending(self) -> int:
        return len(self._remaining_send) + len(self._remaining_recv)

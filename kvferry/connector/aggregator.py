"""KVOutputAggregator: one place where per-worker connector results become one (invariant 3).

A request counts as finished sending (or receiving) once the expected number of distinct
workers reported it: a worker that reports the same request twice counts once. Failures
are unioned, and a failed receive is held until the same request completes its quorum, so
the scheduler sees failure and completion together. A failed receive whose quorum does not
complete within `failed_quorum_steps` aggregation steps is surfaced anyway (as finished and
failed, with a warning) instead of being held forever; late reports for it are dropped,
and it is forgotten once every worker has reported it or another `failed_quorum_steps`
steps have passed (a long-running server keeps no record per abandoned request).
"""

from __future__ import annotations

import logging
from collections import defaultdict

from kvferry.messages.kv_connector import KVConnectorOutput

logger = logging.getLogger(__name__)

DEFAULT_FAILED_QUORUM_STEPS = 64


class KVOutputAggregator:
    def __init__(self, expected_finished_count: int, failed_quorum_steps: int = DEFAULT_FAILED_QUORUM_STEPS):
        assert expected_finished_count >= 1 and failed_quorum_steps >= 1
        self.expected = expected_finished_count
        self.failed_quorum_steps = failed_quorum_steps
        self._send_reporters: dict[str, set[int]] = defaultdict(set)
        self._recv_reporters: dict[str, set[int]] = defaultdict(set)
        self._failed_since: dict[str, int] = {}  # failed receive -> step it was first reported
        # surfaced before their quorum -> (step surfaced, workers that reported it); late
        # reports are dropped until the rest have reported or the bound passes again
        self._abandoned: dict[str, tuple[int, set[int]]] = {}
        self._step = 0

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """Merge one step's outputs; `outputs[i]` is worker i's (None: nothing to report)."""
        self._step += 1
        self._forget_abandoned()
        if all(o is None for o in outputs) and not self._failed_since:
            return None
        result = KVConnectorOutput()
        for worker, out in enumerate(outputs):
            if out is not None:
                self._merge(result, worker, out)
        self._release_failures(result)
        return result

    def _merge(self, result: KVConnectorOutput, worker: int, out: KVConnectorOutput) -> None:
        result.finished_sending |= self._count(self._send_reporters, worker, out.finished_sending)
        failed = out.failed_recving - self._abandoned.keys()
        recving = self._drop_late(worker, out.finished_recving)
        result.finished_recving |= self._count(self._recv_reporters, worker, recving)
        for req_id in failed:
            self._failed_since.setdefault(req_id, self._step)
        result.invalid_block_ids |= out.invalid_block_ids
        result.remote_first_tokens.update(out.remote_first_tokens)
        result.events.extend(out.events)
        if out.stats is not None:
            result.stats = out.stats if result.stats is None else result.stats.aggregate(out.stats)

    def _drop_late(self, worker: int, reported: set[str]) -> set[str]:
        """`reported` without abandoned requests, noting which workers reported those late."""
        late = reported & self._abandoned.keys()
        for req_id in late:
            reporters = self._abandoned[req_id][1]
            reporters.add(worker)
            if len(reporters) >= self.expected:
                del self._abandoned[req_id]
        return reported - late

    def _forget_abandoned(self) -> None:
        """Abandoned requests whose late reports are overdue too are forgotten."""
        for req_id, (since, _) in list(self._abandoned.items()):
            if self._step - since >= self.failed_quorum_steps:
                del self._abandoned[req_id]

    def _count(self, reporters: dict[str, set[int]], worker: int, reported: set[str]) -> set[str]:
        done = set()
        for req_id in reported:
            reporters[req_id].add(worker)
            if len(reporters[req_id]) >= self.expected:
                del reporters[req_id]
                done.add(req_id)
        return done

    def _release_failures(self, result: KVConnectorOutput) -> None:
        """Failures leave with their request's completion, or alone once overdue."""
        for req_id, since in list(self._failed_since.items()):
            if req_id in result.finished_recving:
                result.failed_recving.add(req_id)
                del self._failed_since[req_id]
            elif self._step - since >= self.failed_quorum_steps:
                self._abandon(req_id, result)

    def _abandon(self, req_id: str, result: KVConnectorOutput) -> None:
        reporters = self._recv_reporters.pop(req_id, set())
        reported = len(reporters)
        logger.warning(
            "request %s: receive failed and only %d of %d workers reported it within %d steps; "
            "surfacing the failure without the rest",
            req_id,
            reported,
            self.expected,
            self.failed_quorum_steps,
        )
        del self._failed_since[req_id]
        self._abandoned[req_id] = (self._step, reporters)
        result.finished_recving.add(req_id)
        result.failed_recving.add(req_id)

    @property
    def pending(self) -> int:
        return len(self._send_reporters) + len(self._recv_reporters)

    @property
    def abandoned(self) -> int:
        """Abandoned requests still remembered (to drop their late reports)."""
        return len(self._abandoned)

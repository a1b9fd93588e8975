"""An out-of-tree test connector (loaded by module path): each rank reports late.

The scheduler half delays every request's free (as a P/D producer would); worker rank r
reports the request in finished_sending r + 1 steps after it learned the request
finished. The scheduler half logs, per step, which requests the aggregated output
released, so a test can check that blocks came back only once every rank reported.
"""

from __future__ import annotations

import json

from kvferry.connector.base import KVConnectorBase, KVConnectorMetadata
from kvferry.messages.kv_connector import KVConnectorStats


class StaggeredConnector(KVConnectorBase):
    def __init__(self, engine_config, role, kv_cache_config, tp_rank=0):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        self.log_path = self.extra_config["log_path"]
        self.countdown: dict[str, int] = {}
        self.reported = 0
        self.step = 0

    def _log(self, **fields) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(fields) + "\n")

    # scheduler half
    def build_connector_meta(self, scheduler_output):
        self.step += 1
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self._log(event="finished", req=request.req_id, step=self.step)
        return True, {"staggered": True}

    def update_connector_output(self, output):
        for req_id in output.finished_sending:
            self._log(event="released", req=req_id, step=self.step)

    # worker half
    def get_finished(self, finished_req_ids):
        for req_id in finished_req_ids:
            self.countdown[req_id] = self.tp_rank + 1
        done = set()
        for req_id in list(self.countdown):
            self.countdown[req_id] -= 1
            if self.countdown[req_id] == 0:
                del self.countdown[req_id]
                done.add(req_id)
        self.reported += len(done)
        return done, set()

    def get_stats(self):
        stats, self.reported = KVConnectorStats({"staggered_reports": self.reported}), 0
        return stats

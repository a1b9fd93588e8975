"""An out-of-tree test connector whose load hook raises in chosen forwards."""

from __future__ import annotations

from kvferry.connector.base import KVConnectorBase


class FaultyConnector(KVConnectorBase):
    """Raises in wait_for_layer_load during the forwards numbered in extra_config["fail_forwards"]
    (1-based, counting only forwards with tokens after warm-up). Engines with it take
    --capture always or never: auto's start-up measurement runs more dummy forwards."""

    def __init__(self, engine_config, role, kv_cache_config, tp_rank=0):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        self.fail_forwards = set(self.extra_config.get("fail_forwards", [1]))
        self.forwards = -2  # the warm-up runs two forwards
        self.raised_in_this_forward = False

    def start_load_kv(self):
        self.raised_in_this_forward = False

    def wait_for_layer_load(self, layer_name):
        if layer_name.endswith("layers.0.self_attn.attn"):
            self.forwards += 1
        if self.forwards in self.fail_forwards and not self.raised_in_this_forward:
            self.raised_in_this_forward = True
            raise RuntimeError("injected KV load failure")


class NotAConnector:
    """Does not implement the KV connector API."""

"""Prefill side, layer-wise: which layers of each streamed prefill hold their final KV.

The forward's `save_kv_layer` hook (the engine's thread, inside the compiled program
where there is one) records a layer once its KV for the prompt's last tokens is written;
the side channel (the transfer thread) reads the list to answer a decoder's Progress.
On a CPU the hook runs after the layer's KV write has finished, so a recorded layer's
blocks can be read at once.
"""

from __future__ import annotations

import threading


class LayerProgress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layers: dict[str, list[str]] = {}  # prefill request id -> layers, in order

    def saved(self, request_ids: list[str], layer_name: str) -> None:
        with self._lock:
            for request_id in request_ids:
                self._layers.setdefault(request_id, []).append(layer_name)

    def layers(self, request_id: str) -> list[str]:
        with self._lock:
            return list(self._layers.get(request_id, ()))

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._layers.pop(request_id, None)

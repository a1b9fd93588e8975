"""Run a connector's worker hooks so that a connector failure fails requests, not the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

import torch

from kvferry.connector.base import KVConnectorBase
from kvferry.model.forward_context import AttentionMetadata

logger = logging.getLogger(__name__)


class HookKind(Enum):
    LOAD = "load"  # a failure may leave the step's KV missing
    SAVE = "save"  # a failure only loses the save


class ConnectorGuard:
    """Forwards the per-step hooks to the connector and records what raised.

    A load hook that raises means the KV this step reads may be missing: the caller marks
    the blocks of the step's requests invalid, and the scheduler applies the load-failure
    policy. A save hook that raises only loses the save: it is logged and counted.
    """

    def __init__(self, connector: KVConnectorBase):
        self.connector = connector
        self.load_failed = False
        self.save_failed = False

    def _call(self, kind: HookKind, hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("KV connector %s.%s failed", type(self.connector).__name__, hook.__name__)
            if kind is HookKind.LOAD:
                self.load_failed = True
            else:
                self.save_failed = True

    def start_load_kv(self) -> None:
        self._call(HookKind.LOAD, self.connector.start_load_kv)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._call(HookKind.LOAD, self.connector.wait_for_layer_load, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        self._call(HookKind.SAVE, self.connector.save_kv_layer, layer_name, kv_layer, attn)

    def wait_for_save(self) -> None:
        self._call(HookKind.SAVE, self.connector.wait_for_save)

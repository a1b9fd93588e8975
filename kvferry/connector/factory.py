"""Build connectors by name: built-ins, or out-of-tree classes by module path."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable

from kvferry.config import EngineConfig, KVTransferConfig
from kvferry.connector.base import KVConnectorBase, KVConnectorRole
from kvferry.errors import ConfigError
from kvferry.kv.layout_choice import allocator_party, choose_layout
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.kv_connector import KVTransferParams

logger = logging.getLogger(__name__)

# Built-in connectors: name -> "module:Class", imported only when used.
BUILTIN_CONNECTORS: dict[str, str] = {
    "OffloadConnector": "kvferry.connector.offload.connector:OffloadConnector",
    "MultiConnector": "kvferry.connector.multi:MultiConnector",
    "NixlConnector": "kvferry.connector.nixl.connector:NixlConnector",
    "RecordingConnector": "kvferry.connector.recording:RecordingConnector",
}


def resolve_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The connector class named by config, checked against the API and the role."""
    name = config.kv_connector
    if config.kv_connector_module_path:
        if name is None:
            raise ConfigError("kv_connector_module_path needs kv_connector: the class to load from it")
        module_name, class_name = config.kv_connector_module_path, name
    elif name in BUILTIN_CONNECTORS:
        module_name, class_name = BUILTIN_CONNECTORS[name].split(":")
    else:
        known = ", ".join(sorted(BUILTIN_CONNECTORS))
        raise ConfigError(
            f"unknown KV connector {name!r}; built-in: {known}; or give kv_connector_module_path"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is a configuration problem
        raise ConfigError(f"KV connector module {module_name!r} does not import: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"module {module_name!r} has no connector class {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ConfigError(
            f"{module_name}.{class_name} does not implement the KV connector API (KVConnectorBase)"
        )
    if config.kv_role not in cls.supported_roles:
        raise ConfigError(
            f"{class_name} does not support kv_role {config.kv_role.value!r} (supports {sorted(r.value for r in cls.supported_roles)})"
        )
    return cls


def prepare_engine_config(engine_config: EngineConfig) -> EngineConfig:
    """The config with the connector's start-up decisions applied (see KVConnectorBase.prepare_config)
    and the KV layout every party accepts (kvferry.kv.layout_choice)."""
    if engine_config.kv_transfer.enabled:
        engine_config = resolve_connector_class(engine_config.kv_transfer).prepare_config(engine_config)
    return with_negotiated_layout(engine_config)


def with_negotiated_layout(engine_config: EngineConfig) -> EngineConfig:
    """The config whose cache layout the allocator and every connector accept (invariant 5)."""
    cache = engine_config.cache
    parties = [allocator_party(cache.kv_allocator)]
    if engine_config.kv_transfer.enabled:
        parties += resolve_connector_class(engine_config.kv_transfer).layout_parties(engine_config)
    layout = choose_layout(cache.layout, parties)
    return dataclasses.replace(engine_config, cache=dataclasses.replace(cache, layout=layout))


def kv_params_validator(engine_config: EngineConfig) -> Callable[[KVTransferParams | None], None] | None:
    """The front end's synchronous check of kv_transfer_params, or None without a connector."""
    config = engine_config.kv_transfer
    if not config.enabled:
        return None
    cls = resolve_connector_class(config)
    return functools.partial(cls.validate_kv_transfer_params, config)


def create_connector(
    engine_config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig, tp_rank: int = 0
) -> KVConnectorBase | None:
    config = engine_config.kv_transfer
    if not config.enabled:
        return None
    cls = resolve_connector_class(config)
    logger.info("KV connector %s (%s half, kv_role=%s)", cls.__name__, role.value, config.kv_role)
    return cls(engine_config, role, kv_cache_config, tp_rank)

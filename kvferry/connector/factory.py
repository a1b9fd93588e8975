"""Build connectors by name: built-ins, or out-of-tree classes by module path.

A connector is resolved once per process (`resolve_connector`): its class is found and
checked against the API, the role and the engine's KV layout, and its settings are settled
(KVConnectorBase.settle), and the result rides in `EngineConfig.connector`. The executor's
quorum, the front end's check and every half read that spec; the processes an engine
starts get it with their config, resolved.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable

from kvferry.config import ConnectorSpec, EngineConfig, KVTransferConfig
from kvferry.connector.base import KVConnectorBase, KVConnectorRole, ServedInstance, connector_class
from kvferry.errors import ConfigError
from kvferry.kv.spec import KVCacheConfig, Layout
from kvferry.messages.kv_connector import KVTransferParams

logger = logging.getLogger(__name__)

# Built-in connectors: name -> "module:Class", imported only when used.
BUILTIN_CONNECTORS: dict[str, str] = {
    "OffloadConnector": "kvferry.connector.offload.connector:OffloadConnector",
    "MultiConnector": "kvferry.connector.multi:MultiConnector",
    "NixlConnector": "kvferry.connector.nixl.connector:NixlConnector",
    "RecordingConnector": "kvferry.connector.recording:RecordingConnector",
}


def resolve_connector(engine_config: EngineConfig, served: ServedInstance | None = None) -> EngineConfig:
    """`engine_config` with its connector resolved and its settings settled, once: a config
    resolved already (here or in the process that started this one) comes back as it is.
    `served`: `kvferry serve`'s instance, given where the config is first resolved.
    ConfigError: the connector or its settings refuse the start-up."""
    transfer = engine_config.kv_transfer
    if not transfer.enabled:
        _refuse_unused_secret(None, served)
        return engine_config if engine_config.connector is None else _with(engine_config, None)
    resolved = engine_config.connector
    if resolved is not None and resolved.transfer == transfer:
        assert served is None, "a served instance's settings apply where the config is first resolved"
        return engine_config
    spec = resolve_spec(transfer)
    spec = connector_class(spec).settle(spec, engine_config, served)
    _refuse_unused_secret(spec, served)
    _check_layout(spec, engine_config.cache.layout)
    return _with(engine_config, spec)


def resolve_spec(config: KVTransferConfig) -> ConnectorSpec:
    """The connector named by `config` and the ones it is made of, checked against the API
    and the role; its settings as given (resolve_connector settles them)."""
    cls = _connector_class(config)
    return ConnectorSpec(cls, config, tuple(resolve_spec(part) for part in cls.sub_connectors(config)))


def connector_spec(engine_config: EngineConfig) -> ConnectorSpec | None:
    """The engine's resolved connector, None without one."""
    if not engine_config.kv_transfer.enabled:
        return None
    spec = engine_config.connector
    if spec is None or spec.transfer != engine_config.kv_transfer:
        raise RuntimeError("the engine config's KV connector is not resolved: resolve_connector first")
    return spec


def expected_finished_count(engine_config: EngineConfig) -> int:
    """How many workers must report a request finished (KVConnectorBase.expected_finished_count)."""
    spec = connector_spec(engine_config)
    if spec is None:
        return engine_config.parallel.tensor_parallel_size
    return connector_class(spec).expected_finished_count(engine_config)


def kv_params_validator(engine_config: EngineConfig) -> Callable[[KVTransferParams | None], None] | None:
    """The front end's synchronous check of kv_transfer_params, or None without a connector."""
    spec = connector_spec(engine_config)
    if spec is None:
        return None
    return functools.partial(connector_class(spec).validate_kv_transfer_params, spec)


def kv_stream_source(engine_config: EngineConfig) -> KVTransferParams | None:
    """How a decoder streams this instance's prefills (KVConnectorBase.stream_source)."""
    spec = connector_spec(engine_config)
    return None if spec is None else connector_class(spec).stream_source(spec, engine_config)


def create_connector(
    engine_config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig, tp_rank: int = 0
) -> KVConnectorBase | None:
    spec = connector_spec(engine_config)
    if spec is None:
        return None
    cls = connector_class(spec)
    logger.info("KV connector %s (%s half, kv_role=%s)", cls.__name__, role.value, spec.transfer.kv_role)
    return cls(engine_config, role, kv_cache_config, tp_rank)


def _with(engine_config: EngineConfig, spec: ConnectorSpec | None) -> EngineConfig:
    transfer = engine_config.kv_transfer if spec is None else spec.transfer
    return dataclasses.replace(engine_config, kv_transfer=transfer, connector=spec)


def _connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
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


def _refuse_unused_secret(spec: ConnectorSpec | None, served: ServedInstance | None) -> None:
    """A secret file given on the command line must reach a connector that reads one."""
    if served is None or served.kv_secret_file is None:
        return
    parts = [] if spec is None else list(spec.walk())
    if not any(connector_class(part).takes_secret_file for part in parts):
        raise ConfigError(
            "--kv-transfer-secret-file needs a KV connector that takes a secret (--kv-transfer-config)"
        )


def _check_layout(spec: ConnectorSpec, layout: Layout) -> None:
    """Invariant 5: every connector of the engine works with its --kv-layout."""
    for part in spec.walk():
        cls = connector_class(part)
        if layout not in cls.supported_layouts:
            accepted = "/".join(choice.value for choice in cls.supported_layouts) or "no layout"
            raise ConfigError(
                f"{cls.__name__} works with KV layout {accepted}, not --kv-layout {layout.value}"
            )

"""Options given as JSON objects (--kv-transfer-config, --kv-events-config,
--speculative-config, --kv-connector-extra-config), or as a dict to `LLM(...)`: parsed and
checked one way, each error naming the flag."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from kvferry.errors import ConfigError


def parse_json_flag(text: str, flag: str) -> object:
    """The flag's JSON text parsed; a ConfigError naming the flag if it is not JSON."""
    try:
        value: object = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from exc
    return value


def json_object(value: object, flag: str, keys: Collection[str] | None = None) -> dict[str, Any]:
    """`value` as the flag's object; with `keys`, every key must be one of them."""
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    unknown = set(value) - set(keys) if keys is not None else set()
    if unknown:
        raise ConfigError(f"{flag}: unknown keys {sorted(unknown)}")
    return value

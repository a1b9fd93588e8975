"""Options of the HTTP edge (kvferry/entrypoints/edge.py): body limits and what the API key
guards, with their command-line flags. Light: the CLI imports it to build its parser."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvferry.errors import ConfigError

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 32
# JSON values in one body, counted before parsing (kvferry/entrypoints/edge.py): bounds the
# CPU a body costs, as the byte limit does not (8 MB can be 4 million integers). 2**18 holds
# a prompt of 128K token ids with room to spare; a text prompt counts its , : [ { characters.
DEFAULT_MAX_JSON_VALUES = 2**18
API_PATHS = ("/v1",)
OPS_PATHS = ("/metrics", "/openapi.json")  # they describe the deployment: the key's too, by default


@dataclass(frozen=True)
class EdgeLimits:
    """What a request body may be: its size in bytes, the nesting depth of its JSON and its
    number of JSON values."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_json_values: int = DEFAULT_MAX_JSON_VALUES

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_json_depth, self.max_json_values) < 1:
            raise ConfigError("body size, JSON depth and JSON value limits must be positive")


# -- options ------------------------------------------------------------------------------


def add_edge_args(parser: argparse.ArgumentParser) -> None:
    """The request body limit and whether /metrics and /openapi.json need the API key."""
    parser.add_argument(
        "--max-request-body",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help=f"larger request bodies get HTTP 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--max-json-values",
        type=int,
        default=DEFAULT_MAX_JSON_VALUES,
        metavar="N",
        help="bodies that may hold more JSON values (counting , : [ { characters) get HTTP 400: "
        f"bounds the CPU one body costs (default {DEFAULT_MAX_JSON_VALUES})",
    )
    parser.add_argument(
        "--metrics-public",
        action="store_true",
        help="/metrics and /openapi.json answer without the API key (by default they need it when one is set)",
    )


def limits_from_args(args: argparse.Namespace) -> EdgeLimits:
    return EdgeLimits(max_body_bytes=args.max_request_body, max_json_values=args.max_json_values)


def protected_paths(metrics_public: bool) -> tuple[str, ...]:
    """The path prefixes the API key guards."""
    return API_PATHS if metrics_public else API_PATHS + OPS_PATHS

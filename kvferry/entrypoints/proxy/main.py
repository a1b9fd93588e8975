"""``kvferry proxy --prefill URL [URL ...] --decode URL [URL ...]``: the P/D proxy."""

from __future__ import annotations

import argparse
import logging
import signal

from kvferry.entrypoints.edge_options import add_edge_args, limits_from_args
from kvferry.entrypoints.proxy.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOAD_TOKENS,
    DEFAULT_READ_TIMEOUT_S,
    POLICIES,
    ProxyConfig,
)
from kvferry.entrypoints.proxy_secret import process_proxy_secret

logger = logging.getLogger(__name__)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instance URLs")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instance URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", default="round_robin", choices=POLICIES, help="how an instance is picked")
    add_prefix_args(parser)
    parser.add_argument("--api-key", default=None, help="clients must send it; forwarded to instances")
    parser.add_argument("--health-interval", type=float, default=5.0, help="seconds between health checks")
    parser.add_argument("--health-timeout", type=float, default=2.0)
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        help="seconds an instance may stay silent on a leg (a whole non-streamed answer, or "
        f"between stream events) before the client gets a 504; 0: no limit (default {DEFAULT_READ_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--proxy-secret-file",
        default=None,
        help="file holding the proxy's credential for the instances (or set $KVFERRY_PROXY_SECRET)",
    )
    add_edge_args(parser)
    parser.add_argument(
        "--no-early-first-token",
        dest="early_first_token",
        action="store_false",
        help="do not stream the prefill's token before the decoder's stream",
    )


def add_prefix_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", help="--policy prefix: the instances' model (tokenizer and chat template)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="--policy prefix: the instances' block size",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-kv-events",
            nargs="+",
            default=(),
            metavar="ENDPOINT[,REPLAY]",
            help=f"--policy prefix: where each --{role} instance publishes KV events "
            "(its --kv-events-config endpoints, e.g. tcp://10.0.0.5:5557,tcp://10.0.0.5:5558)",
        )
    parser.add_argument(
        "--prefix-load-tokens",
        type=int,
        default=DEFAULT_LOAD_TOKENS,
        help="--policy prefix: one request in flight weighs as much as this many uncached "
        f"prompt tokens (default {DEFAULT_LOAD_TOKENS})",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="--policy prefix: a request with at most this many prompt tokens not cached on a "
        "decoder is prefilled by the decoder itself, without a KV transfer (default 0: never)",
    )
    parser.add_argument(
        "--idle-decoder-prefills",
        action="store_true",
        help="a request arriving while every prefill instance has a prefill in flight, and a "
        "decode instance has nothing in flight, is prefilled by that decoder itself",
    )
    parser.add_argument(
        "--local-on-prefillers",
        action="store_true",
        help="a request sent to a decoder to prefill itself (--local-prefill-tokens, "
        "--idle-decoder-prefills) is answered whole by a prefill instance instead when one has "
        "fewer requests in flight than every decode instance",
    )


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        policy=args.policy,
        api_key=args.api_key,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout or None,
        early_first_token=args.early_first_token,
        limits=limits_from_args(args),
        metrics_public=args.metrics_public,
        proxy_secret=process_proxy_secret(args.proxy_secret_file),
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        prefill_kv_events=tuple(args.prefill_kv_events),
        decode_kv_events=tuple(args.decode_kv_events),
        prefix_load_tokens=args.prefix_load_tokens,
        local_prefill_tokens=args.local_prefill_tokens,
        idle_decoder_prefills=args.idle_decoder_prefills,
        local_on_prefillers=args.local_on_prefillers,
    )


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from kvferry.entrypoints.edge_http import StrictH11Protocol
    from kvferry.entrypoints.proxy.app import build_app

    config = config_from_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per upstream request
    app = build_app(config)
    logger.info(
        "proxy on http://%s:%d: prefill %s, decode %s (%s)",
        args.host,
        args.port,
        " ".join(config.prefill_urls),
        " ".join(config.decode_urls),
        config.policy,
    )
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the
    # handler it replaced: this one, so a stop asked for ends with exit code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_zero)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=level,
        timeout_graceful_shutdown=5,
        http=StrictH11Protocol,
    )


def _exit_zero(signum: int, _frame: object) -> None:
    raise SystemExit(0)

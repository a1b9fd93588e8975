"""``kvferry disagg MODEL --prefill N --decode M``: a P/D deployment on localhost.

Starts N prefill instances (``kvferry serve``, KV connector role producer), M decode
instances (role consumer) and the proxy, each a subprocess in its own process group with
a free port and a log file; waits until every one is healthy (on failure: its log tail,
and everything started so far is stopped); prints the proxy URL; on Ctrl-C or SIGTERM
stops the proxy, then the instances (SIGTERM, then SIGKILL of the whole group after a
grace period), leaving no process behind. Children also get SIGTERM if the launcher dies.
A process that dies meanwhile is restarted as it was started, or left down past its
restarts; the deployment ends (non-zero) once a role has none left (disagg_supervisor.py).

``--kv-connector none`` starts colocated instances without a connector: the decoder then
recomputes the prompt and ignores the prefill's ``kv_transfer_params``.

Secrets travel by environment, never on a command line (docs/security.md): the API key
(``--api-key-file``, ``$KVFERRY_API_KEY`` or ``--api-key``) reaches every child as
``$KVFERRY_API_KEY``; the KV side channel's shared secret (``$KVFERRY_KV_SECRET`` if set,
else a fresh random one) reaches the instances, not the proxy; the proxy's credential
(``$KVFERRY_PROXY_SECRET`` if set, else a fresh one) reaches the proxy and the instances.
Decoders dial only the side channels of the prefillers started here (``allowed_remotes``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvferry.config import KVRole
from kvferry.connector.nixl.auth import SECRET_ENV
from kvferry.entrypoints.disagg_supervisor import add_restart_args, restart_policy, supervise
from kvferry.entrypoints.edge_options import add_edge_args
from kvferry.entrypoints.http_common import API_KEY_ENV
from kvferry.entrypoints.proxy.config import DEFAULT_LOAD_TOKENS, POLICIES
from kvferry.entrypoints.proxy_secret import PROXY_SECRET_ENV
from kvferry.errors import ConfigError, KVFerryError
from kvferry.json_flags import json_object, parse_json_flag
from kvferry.ports import bindable, free_port, reserve_port
from kvferry.worker.cpu_placement import available_cores, format_core_list

logger = logging.getLogger(__name__)

DEFAULT_CONNECTOR = "NixlConnector"
NO_CONNECTOR = "none"
KV_ROLES = {"prefill": KVRole.PRODUCER, "decode": KVRole.CONSUMER}
# Engine options that disagg sets per role itself, so they are not passed through.
OWN_ENGINE_OPTIONS = {"help", "tensor_parallel_size", "kv_transfer_config", "cpu_cores", "kv_events_config"}
LOG_TAIL_BYTES = 4000
PR_SET_PDEATHSIG = 1


class LaunchError(KVFerryError):
    """A process of the deployment failed to start or died."""


@dataclass
class Child:
    name: str  # prefill-0, decode-1, proxy
    cmd: list[str]
    url: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # set in the child's environment
    proc: subprocess.Popen[bytes] | None = None
    side_channel_port: int | None = None
    kv_events: str | None = None  # where it publishes KV events: ENDPOINT,REPLAY_ENDPOINT

    def started(self) -> subprocess.Popen[bytes]:
        """The child's process (only started children are stopped or watched)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc

    @property
    def role(self) -> str:
        """prefill, decode or proxy."""
        return self.name.rpartition("-")[0] or self.name

    def exit_code(self) -> int | None:
        """None while it runs (or before it was started)."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self) -> str:
        try:
            data = self.log.read_bytes()[-LOG_TAIL_BYTES:]
        except OSError:
            return "(no log)"
        return data.decode("utf-8", "replace")


# ---- arguments ------------------------------------------------------------------------


def _engine_parser() -> argparse.ArgumentParser:
    """`kvferry serve`'s engine and HTTP-edge options: what disagg passes to its instances."""
    from kvferry.entrypoints.engine_args import add_engine_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    add_edge_args(parser)
    return parser


def _edge_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_edge_args(parser)
    return [a for a in parser._actions if a.option_strings]


def edge_argv(args: argparse.Namespace) -> list[str]:
    """The HTTP-edge options given (body limit, public metrics), for the proxy: it guards
    the same edge as the instances."""
    return _argv(args, _edge_actions())


def _passthrough_actions() -> list[argparse.Action]:
    """`kvferry serve`'s engine options, less those disagg sets per role."""
    return [a for a in _engine_parser()._actions if a.option_strings and a.dest not in OWN_ENGINE_OPTIONS]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="smollm2", help="as for `kvferry serve`")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="number of decode instances")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor parallel size of prefill instances")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor parallel size of decode instances")
    parser.add_argument("--host", default="127.0.0.1", help="the proxy's host")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument(
        "--policy",
        default="round_robin",
        choices=POLICIES,
        help="how the proxy picks an instance; prefix: by where the prompt's KV is cached, "
        "weighed against load (implies --kv-events)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="every instance publishes its prefix cache's changes (KV events, vLLM's wire "
        "format) on its own loopback ports",
    )
    parser.add_argument(
        "--prefix-load-tokens", type=int, default=DEFAULT_LOAD_TOKENS, help="as for `kvferry proxy`"
    )
    parser.add_argument("--local-prefill-tokens", type=int, default=0, help="as for `kvferry proxy`")
    parser.add_argument("--idle-decoder-prefills", action="store_true", help="as for `kvferry proxy`")
    parser.add_argument("--local-on-prefillers", action="store_true", help="as for `kvferry proxy`")
    parser.add_argument(
        "--api-key",
        default=None,
        help="required by the proxy and the instances (visible in the process list: prefer "
        "$KVFERRY_API_KEY or --api-key-file); passed to them by environment",
    )
    parser.add_argument("--api-key-file", default=None, help="file holding the API key")
    parser.add_argument(
        "--kv-connector", default=DEFAULT_CONNECTOR, help=f"connector name, or '{NO_CONNECTOR}' (colocated)"
    )
    parser.add_argument("--kv-connector-extra-config", default="{}", help="JSON merged into each instance's")
    parser.add_argument("--kv-load-failure-policy", default=None, choices=["fail", "recompute"])
    parser.add_argument(
        "--cpu-split",
        default="even",
        choices=["even", "none"],
        help="CPU: give each instance its own cores, an equal share per TP rank (even), or share all (none)",
    )
    parser.add_argument("--log-dir", default=None, help="instance logs (default: a new temporary dir)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to become healthy")
    parser.add_argument("--stop-timeout", type=float, default=20.0, help="grace seconds before SIGKILL")
    add_restart_args(parser)
    engine = parser.add_argument_group("engine options (passed to every instance)")
    for action in _passthrough_actions():
        engine._add_action(action)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options given on the command line, as `kvferry serve` arguments."""
    return _argv(args, _passthrough_actions())


def _argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """`actions`' options that differ from their defaults, as command-line arguments."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def kv_transfer_json(
    connector: str, role: str, extra: dict[str, Any], side_port: int | None, policy: str | None
) -> str | None:
    """The --kv-transfer-config of one instance (None without a connector). A prefill
    instance's side channel (where decoders handshake and ask for its blocks) listens on
    ``side_port`` of 127.0.0.1 (TP rank 0; other ranks pick free ports themselves)."""
    if connector == NO_CONNECTOR:
        return None
    channel = {"side_channel_host": "127.0.0.1", "side_channel_port": side_port} if side_port else {}
    config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": KV_ROLES[role].value,
        "kv_connector_extra_config": {**channel, **extra},
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return json.dumps(config)


def check_connector(args: argparse.Namespace) -> dict[str, Any]:
    """Fail fast on a connector that does not resolve; the parsed extra config."""
    flag = "--kv-connector-extra-config"
    extra = json_object(parse_json_flag(args.kv_connector_extra_config, flag), flag)
    if args.kv_connector != NO_CONNECTOR:
        from kvferry.connector.factory import resolve_spec
        from kvferry.entrypoints.engine_args import parse_kv_transfer_config

        for role in KV_ROLES:  # imports the connector and checks that it supports both roles
            raw = kv_transfer_json(args.kv_connector, role, extra, 0, args.kv_load_failure_policy)
            try:
                resolve_spec(parse_kv_transfer_config(raw))
            except ConfigError as exc:
                raise ConfigError(
                    f"{exc} (--kv-connector {NO_CONNECTOR} starts colocated instances)"
                ) from exc
    return extra


# ---- processes --------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def child_environment(own: dict[str, str]) -> dict[str, str]:
    """The launcher's environment without the KV side-channel secret (only instances get
    it, in ``own``), plus the child's own variables."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    return {**env, **own}


def deployment_secrets(args: argparse.Namespace) -> dict[str, str]:
    """The secrets the proxy and every instance get by environment: API key, proxy credential."""
    env = {API_KEY_ENV: args.api_key} if args.api_key else {}
    env[PROXY_SECRET_ENV] = os.environ.get(PROXY_SECRET_ENV) or secrets.token_hex(32)
    return env


def instance_secrets(
    args: argparse.Namespace, extra: dict[str, Any], shared: dict[str, str] | None = None
) -> dict[str, str]:
    """The secrets every instance gets by environment: ``shared`` (default: the API key),
    the KV side-channel secret."""
    env = dict(shared) if shared is not None else ({API_KEY_ENV: args.api_key} if args.api_key else {})
    if args.kv_connector != NO_CONNECTOR and not extra.get("secret_file"):
        env[SECRET_ENV] = os.environ.get(SECRET_ENV) or secrets.token_hex(32)
    return env


def decoder_extra(extra: dict[str, Any], prefill_side_ports: list[int]) -> dict[str, Any]:
    """A decoder's connector settings: it dials only the prefillers started here (their TP
    rank 0 side channels), unless the extra config names its own allow-list."""
    allowed = [f"127.0.0.1:{port}" for port in prefill_side_ports]
    return {"allowed_remotes": allowed, **extra}


def spawn(child: Child, append: bool = False) -> None:
    """Start the child, its output in its log (``append``: after the previous run's)."""
    parent = os.getpid()
    with open(child.log, "ab" if append else "wb") as out:
        child.proc = subprocess.Popen(
            child.cmd,
            env=child_environment(child.env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole, no stray signals
            preexec_fn=lambda: _die_with_parent(parent),
        )
    logger.info("started %s (pid %d): %s", child.name, child.proc.pid, " ".join(child.cmd))


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(children: list[Child], deadline: float, stop: threading.Event) -> None:
    """Return once every child answers /health with 200; raise LaunchError if one exits first.
    One client asks them all: a client per request built an SSL context each time (~50 ms
    of CPU, 5 times a second per child, while the children start on the same cores)."""
    waiting = list(children)
    with httpx.Client() as http:
        while waiting:
            for child in list(waiting):
                assert child.proc is not None
                if child.proc.poll() is not None:
                    raise LaunchError(
                        f"{child.name} exited with code {child.proc.returncode} while starting; "
                        f"log {child.log}:\n{child.log_tail()}"
                    )
                if _healthy(http, child.url):
                    logger.info("%s is healthy at %s", child.name, child.url)
                    waiting.remove(child)
            if stop.is_set():
                raise LaunchError("interrupted while starting")
            if waiting and time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting)
                raise LaunchError(
                    f"not healthy in time: {names}; log {waiting[0].log}:\n{waiting[0].log_tail()}"
                )
            if waiting:
                stop.wait(0.2)


def stop_all(children: list[Child], grace: float) -> None:
    """SIGTERM each started child (in order), wait up to ``grace``, then SIGKILL whatever is left
    of each one's process group (its engine core, TP workers).

    `kvferry serve` and `kvferry proxy` stop cleanly on SIGTERM (open requests end with an
    error, the engine core is shut down), as under any process manager.
    """
    started = [c for c in children if c.proc is not None]
    for child in started:
        if child.started().poll() is None:
            _signal_group_leader(child, signal.SIGTERM)
    begin = time.monotonic()
    pending = list(started)
    while pending and time.monotonic() < begin + grace:
        for child in [c for c in pending if c.started().poll() is not None]:
            pending.remove(child)
            logger.info(
                "%s stopped (exit code %s) after %.1f s",
                child.name,
                child.started().returncode,
                time.monotonic() - begin,
            )
        time.sleep(0.05)
    for child in pending:
        logger.warning("%s did not stop in %.0f s: killing it", child.name, grace)
    for child in started:
        if _kill_group(child):  # the leader's leftovers too: its engine core, TP workers
            _wait_group_gone(child)
        child.started().wait()


def _signal_group_leader(child: Child, sig: int) -> None:
    try:
        child.started().send_signal(sig)
    except ProcessLookupError:
        pass


def _kill_group(child: Child) -> bool:
    """SIGKILL the child's process group; whether anything was left in it."""
    try:
        os.killpg(child.started().pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False  # the group is gone: nothing left behind
    return True


def _wait_group_gone(child: Child, timeout: float = 5.0) -> None:
    """Reap the leader, then wait (bounded) until the kernel has removed the whole group."""
    child.started().wait()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(child.started().pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)
    logger.warning(
        "%s: processes of its group still exist (zombies?) %.0f s after SIGKILL", child.name, timeout
    )


def reap(child: Child) -> None:
    """Kill what an exited child left in its process group (its engine core, TP workers)."""
    if _kill_group(child):
        _wait_group_gone(child)


def restart(child: Child) -> None:
    spawn(child, append=True)


# ---- the deployment ---------------------------------------------------------------------


def _cli(args: argparse.Namespace, command: str) -> list[str]:
    level = getattr(args, "log_level", "INFO")
    return [sys.executable, "-m", "kvferry.entrypoints.cli", "--log-level", level, command]


def split_cores(rank_counts: list[int], cores: tuple[int, ...]) -> list[tuple[int, ...] | None]:
    """Disjoint cores per instance, the same number per TP rank (the remainder unused);
    all None (unpinned) when there are fewer cores than ranks."""
    per_rank = len(cores) // sum(rank_counts)
    if per_rank == 0:
        logger.warning("%d cores for %d ranks: instances share all cores", len(cores), sum(rank_counts))
        return [None] * len(rank_counts)
    shares: list[tuple[int, ...] | None] = []
    start = 0
    for ranks in rank_counts:
        shares.append(cores[start : start + ranks * per_rank])
        start += ranks * per_rank
    return shares


def plan_instances(
    args: argparse.Namespace, extra: dict[str, Any], log_dir: Path, shared: dict[str, str] | None = None
) -> list[Child]:
    passthrough = engine_argv(args)
    env = instance_secrets(args, extra, deployment_secrets(args) if shared is None else shared)
    with_channel = args.kv_connector != NO_CONNECTOR
    side_ports = [free_port() for _ in range(args.prefill)] if with_channel else []
    roles = [("prefill", i, args.prefill_tp) for i in range(args.prefill)]
    roles += [("decode", i, args.decode_tp) for i in range(args.decode)]
    if args.cpu_split == "even":
        shares = split_cores([tp for _, _, tp in roles], available_cores())
    else:
        shares = [None] * len(roles)
    children = []
    for (role, i, tp), cores in zip(roles, shares, strict=True):
        port = free_port()
        side_port = side_ports[i] if role == "prefill" and with_channel else None
        own_extra = decoder_extra(extra, side_ports) if role == "decode" else extra
        cmd = _cli(args, "serve") + [args.model, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        cmd += ["--cpu-cores", format_core_list(cores)] if cores else []
        cmd += passthrough
        kv = kv_transfer_json(args.kv_connector, role, own_extra, side_port, args.kv_load_failure_policy)
        cmd += ["--kv-transfer-config", kv] if kv else []
        events = kv_events_ports() if args.kv_events or args.policy == "prefix" else None
        cmd += ["--kv-events-config", kv_events_json(*events)] if events else []
        name = f"{role}-{i}"
        url = f"http://127.0.0.1:{port}"
        child = Child(name, cmd, url, log_dir / f"{name}.log", env, side_channel_port=side_port)
        child.kv_events = None if events is None else "tcp://127.0.0.1:{},tcp://127.0.0.1:{}".format(*events)
        children.append(child)
    return children


def kv_events_ports() -> tuple[int, int]:
    """An instance's KV event ports (PUB, replay), kept across its restarts."""
    return free_port(), free_port()


def kv_events_json(pub_port: int, replay_port: int) -> str:
    """An instance's --kv-events-config: both sockets bound on loopback (token ids of
    prompts travel on them: docs/security.md)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "bind": True,
    }
    return json.dumps(config)


def prefix_argv(args: argparse.Namespace, instances: list[Child]) -> list[str]:
    """The proxy's --policy prefix options: the model's tokenizer, the block size and each
    instance's event endpoints."""
    if args.policy != "prefix":
        return []
    argv = ["--tokenizer", args.model, "--prefix-load-tokens", str(args.prefix_load_tokens)]
    argv += ["--local-prefill-tokens", str(args.local_prefill_tokens)]
    argv += ["--block-size", str(args.block_size)] if args.block_size else []
    for role in ("prefill", "decode"):
        argv += [f"--{role}-kv-events"] + [c.kv_events or "" for c in instances if c.role == role]
    return argv


def plan_proxy(
    args: argparse.Namespace, instances: list[Child], log_dir: Path, shared: dict[str, str]
) -> Child:
    cmd = _cli(args, "proxy")
    cmd += ["--prefill"] + [c.url for c in instances if c.name.startswith("prefill")]
    cmd += ["--decode"] + [c.url for c in instances if c.name.startswith("decode")]
    cmd += ["--host", args.host, "--port", str(args.port), "--policy", args.policy]
    cmd += ["--health-interval", str(args.health_interval)] if args.health_interval else []
    cmd += prefix_argv(args, instances)
    cmd += ["--idle-decoder-prefills"] if args.idle_decoder_prefills else []
    cmd += ["--local-on-prefillers"] if args.local_on_prefillers else []
    cmd += edge_argv(args)
    env = dict(shared)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return Child("proxy", cmd, f"http://{host}:{args.port}", log_dir / "proxy.log", env)


def _check_args(args: argparse.Namespace) -> None:
    if args.prefill < 1 or args.decode < 1:
        raise ConfigError("--prefill and --decode need at least one instance each")
    if args.prefill_tp < 1 or args.decode_tp < 1:
        raise ConfigError("--prefill-tp and --decode-tp must be at least 1")
    restart_policy(args)  # its ConfigError before anything starts
    if not bindable(args.host if args.host else "0.0.0.0", args.port):
        raise ConfigError(f"the proxy's port {args.port} on {args.host} is in use (--port)")
    reserve_port(args.port)  # bound only once the instances are up: none of them may take it


def _install_signal_handlers(stop: threading.Event) -> None:
    def on_signal(signum: int, _frame: object) -> None:
        if not stop.is_set():
            logger.info("%s: stopping everything", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def start(children: list[Child], proxy: Child, timeout: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    for child in children:
        spawn(child)
    wait_healthy(children, deadline, stop)
    spawn(proxy)
    wait_healthy([proxy], deadline, stop)


def run(args: argparse.Namespace) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll
    _check_args(args)
    extra = check_connector(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-disagg-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shared = deployment_secrets(args)
    instances = plan_instances(args, extra, log_dir, shared)
    proxy = plan_proxy(args, instances, log_dir, shared)
    stop = threading.Event()
    _install_signal_handlers(stop)
    policy = restart_policy(args)
    lost = None
    try:
        start(instances, proxy, args.startup_timeout, stop)
        prefill = " ".join(c.url for c in instances if c.name.startswith("prefill"))
        decode = " ".join(c.url for c in instances if c.name.startswith("decode"))
        connector = args.kv_connector
        print(
            f"kvferry disagg: proxy ready at {proxy.url} (prefill: {prefill}; decode: {decode}; "
            f"connector: {connector}; logs: {log_dir})",
            flush=True,
        )
        lost = supervise(instances + [proxy], policy, stop, restart=restart, reap=reap)
    finally:
        stop_all([proxy] + instances, args.stop_timeout)
    if lost is not None:
        dead = next(c for c in instances + [proxy] if c.name == lost.last.name)
        raise LaunchError(f"{lost.message(policy)}. log {dead.log}:\n{dead.log_tail()}")
    logger.info("all stopped")

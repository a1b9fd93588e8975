"""``kvferry bench transfer``: KV-block transfer bandwidth over NIXL vs a plain memory copy.

Two NIXL agents in two processes, as in P/D: a *target* (the prefiller) holds a source
buffer, an *initiator* (the decoder, this process) READs blocks of it into its own
buffer. For each buffer size and block size, the buffer is cut into blocks and the blocks
are moved in a shuffled order (KV blocks of a request are scattered in the pool, so NIXL
cannot merge neighbours into one big descriptor): one transfer of ``size / block``
descriptors, timed from post to completion. The agents run without a progress thread
(polled explicitly: 2-core machines), buffers are touched before registration (no page
faults inside the timing), and every moved block is checked once. Baselines, same bytes in
this process: ``torch copy_`` of the whole buffer, and ``index_copy_`` of the shuffled
blocks (gather + scatter). Results: JSON and a PNG of GB/s vs block size.

``--connector MODEL`` measures the NixlConnector itself instead: a prefill and a decode
engine of MODEL in this process (``kv_role`` producer / consumer, real NIXL agents), one
prompt of each ``--prompt-tokens`` length at a time prefilled on one and decoded on the
other, ``--iters`` times; per prompt the decoder's connector stats give the bytes, NIXL
descriptors and READ time. The pools hold little more than the longest prompt, and a
warm-up round fills them once, so block ids come as on a busy server (freed blocks return
to the pool last-first) rather than the fresh pool's ascending ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from kvferry.errors import KVFerryError
from kvferry.kv.spec import KVAllocator
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

MB = 1 << 20
KB = 1 << 10
XFER_TIMEOUT_S = 60.0


class TransferBenchError(KVFerryError):
    """NIXL is missing, or a transfer failed or did not finish."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=float, nargs="+", default=[64.0], help="bytes moved per transfer")
    parser.add_argument("--block-kb", type=float, nargs="+", default=[4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--iters", type=int, default=10, help="timed transfers per setting")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--op", default="READ", choices=["READ", "WRITE"], help="READ: pull, as a decoder does"
    )
    parser.add_argument("--backend", default="UCX")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench-results/transfer.json")
    parser.add_argument(
        "--connector",
        metavar="MODEL",
        help="measure the NixlConnector between a prefill and a decode engine of MODEL instead",
    )
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 4000], help="with --connector")
    parser.add_argument(
        "--kv-allocator",
        type=KVAllocator,
        choices=list(KVAllocator),
        default=KVAllocator.EAGER,
        help="with --connector: both engines' KV memory (elastic: pages mapped while in use)",
    )
    for side in ("prefill", "decode"):
        parser.add_argument(
            f"--{side}-layout",
            default="NHD",
            choices=["NHD", "HND"],
            help=f"with --connector: the {side} KV layout",
        )


@dataclass(frozen=True)
class Setting:
    size: int  # bytes
    block: int  # bytes

    @property
    def count(self) -> int:
        return self.size // self.block


def make_agent(name: str, backend: str):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise TransferBenchError(f"nixl is not installed: {exc}") from exc
    logging.getLogger("nixl").setLevel(logging.WARNING)
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[backend])
    return nixl_agent(name, config)


PERIOD = 251  # source byte i holds i mod 251: a misplaced block or offset shows


def touched_buffer(size: int, pattern: bool):
    """A uint8 buffer whose every page is written (allocated) before registration."""
    import torch

    if not pattern:
        return torch.zeros(size, dtype=torch.uint8)
    period = torch.arange(PERIOD, dtype=torch.uint8)
    return period.repeat(-(-size // PERIOD))[:size].clone()


# ---- the target process (prefiller side) --------------------------------------------------


def target_main(conn, size: int, backend: str) -> None:
    """Hold a registered source buffer and keep the agent progressing until told to stop."""
    agent = make_agent("kvferry-bench-target", backend)
    buf = touched_buffer(size, pattern=True)
    reg = agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll(0.001):  # poll explicitly: no progress thread
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)
    conn.send("stopped")


# ---- the initiator (decoder side) --------------------------------------------------------


class Initiator:
    def __init__(self, size: int, backend: str, remote_meta: bytes, remote_base: int) -> None:
        self.agent = make_agent("kvferry-bench-initiator", backend)
        self.buf = touched_buffer(size, pattern=False)
        self.reg = self.agent.register_memory(self.buf)
        self.remote = self.agent.add_remote_agent(remote_meta)
        self.remote_base = remote_base

    def descs(self, base: int, order, block: int):
        import numpy as np

        rows = np.zeros((len(order), 3), dtype=np.uint64)
        rows[:, 0] = base + np.asarray(order, dtype=np.uint64) * block
        rows[:, 1] = block
        return rows

    def measure(self, s: Setting, op: str, iters: int, warmup: int, perms) -> dict:
        import numpy as np

        local_order, remote_order = perms
        t0 = time.perf_counter()
        local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.descs(self.buf.data_ptr(), local_order, s.block), "DRAM"
        )
        remote = self.agent.prep_xfer_dlist(
            self.remote, self.descs(self.remote_base, remote_order, s.block), "DRAM"
        )
        idx = np.arange(s.count, dtype=np.int32)
        handle = self.agent.make_prepped_xfer(op, local, idx, remote, idx)
        prep = time.perf_counter() - t0
        try:
            times = [self._one(handle) for _ in range(warmup + iters)][warmup:]
        finally:
            self.agent.release_xfer_handle(handle)
            self.agent.release_dlist_handle(local)
            self.agent.release_dlist_handle(remote)
        return {"prep_ms": 1000 * prep, "times": times}

    def _one(self, handle) -> float:
        start = time.perf_counter()
        state = self.agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() - start > XFER_TIMEOUT_S:
                raise TransferBenchError(f"a NIXL transfer did not finish in {XFER_TIMEOUT_S} s")
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferBenchError(f"NIXL transfer failed: {state}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.reg)


def verify(dst, s: Setting, perms, chunk_bytes: int = 4 * MB) -> None:
    """The blocks READ into ``dst`` hold the target's pattern (byte i = i mod PERIOD)."""
    import torch

    local_order, remote_order = (torch.as_tensor(p, dtype=torch.int64) for p in perms)
    blocks = dst[: s.size].view(s.count, s.block)
    step = max(1, chunk_bytes // s.block)
    offsets = torch.arange(s.block, dtype=torch.int64)
    for first in range(0, s.count, step):
        got = blocks.index_select(0, local_order[first : first + step])
        want = (remote_order[first : first + step, None] * s.block + offsets).remainder_(PERIOD)
        if not torch.equal(got, want.to(torch.uint8)):
            raise TransferBenchError(f"wrong bytes after a transfer of {s.count} blocks of {s.block} B")


def memcpy_gbps(s: Setting, iters: int, perms) -> dict:
    """GB/s of torch copy_ of the whole buffer, and index_copy_ of the shuffled blocks."""
    import torch

    wide = torch.int64 if s.block % 8 == 0 else torch.uint8  # uint8 index kernels are slow
    src = touched_buffer(s.size, pattern=True).view(wide).view(s.count, -1)
    dst = touched_buffer(s.size, pattern=False).view(wide).view(s.count, -1)
    local, remote = (torch.as_tensor(p) for p in perms)
    copy = _best_of(iters, lambda: dst.copy_(src))
    index_copy = _best_of(iters, lambda: dst.index_copy_(0, local, src.index_select(0, remote)))
    return {"copy_gbps": s.size / copy / 1e9, "index_copy_gbps": s.size / index_copy / 1e9}


def _best_of(iters: int, fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def settings_of(args: argparse.Namespace) -> list[Setting]:
    out = []
    for size_mb in args.size_mb:
        size = int(size_mb * MB)
        for block_kb in args.block_kb:
            block = int(block_kb * KB)
            if block <= 0 or size < block or size % block:
                raise TransferBenchError(f"{size_mb} MB is not a whole number of {block_kb} KB blocks")
            out.append(Setting(size, block))
    return out


def run_settings(args: argparse.Namespace, settings: list[Setting], init: Initiator) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    results = []
    for s in settings:
        perms = (rng.permutation(s.count), rng.permutation(s.count))
        m = init.measure(s, args.op, args.iters, args.warmup, perms)
        if args.op == "READ":
            verify(init.buf, s, perms)
        median = statistics.median(m["times"])
        row = {
            "size_mb": s.size / MB,
            "block_kb": s.block / KB,
            "descriptors": s.count,
            "nixl_gbps": s.size / median / 1e9,
            "nixl_gbps_best": s.size / min(m["times"]) / 1e9,
            "nixl_ms": 1000 * median,
            "nixl_prep_ms": m["prep_ms"],
            **memcpy_gbps(s, args.iters, perms),
        }
        logger.info(
            "%g MB in %d x %g KB: NIXL %s %.2f GB/s (prep %.1f ms), copy_ %.2f GB/s, index_copy_ %.2f GB/s",
            row["size_mb"], s.count, row["block_kb"], args.op, row["nixl_gbps"], row["nixl_prep_ms"],
            row["copy_gbps"], row["index_copy_gbps"],
        )  # fmt: skip
        results.append(row)
    return results


def run(args: argparse.Namespace) -> dict:
    if args.connector:
        return run_connector(args)
    if args.kv_allocator is not KVAllocator.EAGER:
        raise TransferBenchError("--kv-allocator is for --connector (the engines' KV memory)")

    settings = settings_of(args)
    size = max(s.size for s in settings)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child, size, args.backend), name="kvferry-bench-target")
    target.start()
    try:
        if not parent.poll(120):
            raise TransferBenchError("the target agent did not start")
        meta, base = parent.recv()
        init = Initiator(size, args.backend, meta, base)
        try:
            results = run_settings(args, settings, init)
        finally:
            init.close()
        parent.send("stop")
        parent.poll(10)
    finally:
        target.join(10)
        if target.is_alive():
            target.kill()
            target.join()
    doc = {
        "bench": "transfer",
        "op": args.op,
        "backend": args.backend,
        "iters": args.iters,
        **host_facts(),
        "results": results,
    }
    plot(doc, save_json(doc, args.output).with_suffix(".png"))
    print(json.dumps(doc, indent=2))
    return doc


def plot(doc: dict, path: Path) -> bool:
    from kvferry_bench.plot import Panel, Series, save_panels

    rate = Panel("bandwidth", "GB/s")
    prep = Panel("NIXL descriptor preparation", "ms", logy=True)
    for size in sorted({r["size_mb"] for r in doc["results"]}):
        rows = [r for r in doc["results"] if r["size_mb"] == size]
        xs = [r["block_kb"] for r in rows]
        tag = f"{size:g} MB"
        rate.series.append(Series(f"NIXL {doc['op']} {tag}", xs, [r["nixl_gbps"] for r in rows]))
        rate.series.append(Series(f"copy_ {tag}", xs, [r["copy_gbps"] for r in rows], "--"))
        rate.series.append(Series(f"index_copy_ {tag}", xs, [r["index_copy_gbps"] for r in rows], ":s"))
        prep.series.append(Series(f"NIXL {tag}", xs, [r["nixl_prep_ms"] for r in rows]))
    title = f"KV block transfer, NIXL {doc['backend']} between two processes vs memcpy"
    blocks = sorted({r["block_kb"] for r in doc["results"]})
    ticks = (blocks, [f"{b:g}" for b in blocks])
    return save_panels(path, [rate, prep], "block size (KB)", title, xticks=ticks, logx=True)


# ---- --connector MODEL: the NixlConnector between two engines ------------------------------


def connector_config(args: argparse.Namespace, role: str, layout: str):
    """An engine of args.connector whose pool holds the longest prompt and a few blocks more,
    eager: each round prefills on one engine and computes one token on the other, so no step
    is a decode step that the captured forward would run (compiling it would only cost time)."""
    from kvferry.config import CacheConfig, CompilationConfig, EngineConfig, KVTransferConfig
    from kvferry.model.resolve import resolve_model_config

    block_size = 16
    longest = max(args.prompt_tokens)
    model = resolve_model_config(args.connector, dtype="float32", max_model_len=longest + block_size)
    blocks = -(-(longest + 1) // block_size) + 4
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=block_size,
            num_gpu_blocks_override=blocks,
            layout=layout,
            kv_allocator=args.kv_allocator,
        ),
        kv_transfer=KVTransferConfig("NixlConnector", kv_role=role),
        compilation=CompilationConfig(enforce_eager=True),
    )


def finish(engine, request, other) -> object:
    """Step `engine` until `request` finishes, stepping `other` too (it serves the lease)."""
    engine.add_request(request)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise TransferBenchError(f"{request.req_id} failed: {out.error}")
                return out
        if other.has_unfinished_requests():
            other.step()
    raise TransferBenchError(f"{request.req_id} did not finish")


def drain(*engines) -> None:
    """Step until every lease and load is settled (the prefiller's blocks are free again)."""
    deadline = time.monotonic() + 60
    while any(e.has_unfinished_requests() for e in engines):
        if time.monotonic() > deadline:
            raise TransferBenchError("KV transfers still pending after 60 s")
        for engine in engines:
            if engine.has_unfinished_requests():
                engine.step()


def pd_round(prefiller, decoder, tag: str, prompt: list[int]) -> dict[str, float]:
    """Prefill on one engine, decode one token on the other: the decoder's connector stats."""
    from kvferry.messages.engine_core import EngineCoreRequest
    from kvferry.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0)
    before = dict(decoder.stats().kv_connector)
    prefill = EngineCoreRequest(f"{tag}-p", prompt, one, time.time(), {"do_remote_decode": True})
    params = finish(prefiller, prefill, decoder).kv_transfer_params
    finish(decoder, EngineCoreRequest(f"{tag}-d", prompt, one, time.time(), params), prefiller)
    drain(prefiller, decoder)
    after = decoder.stats().kv_connector
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}


def connector_rows(args: argparse.Namespace, prefiller, decoder) -> list[dict]:
    import random

    rng = random.Random(args.seed)
    vocab = prefiller.config.model.vocab_size

    def prompt(n: int) -> list[int]:  # fresh tokens every time: no prefix-cache hits
        return [rng.randrange(vocab) for _ in range(n)]

    pd_round(prefiller, decoder, "warmup", prompt(max(args.prompt_tokens)))
    rows = []
    for n in args.prompt_tokens:
        for i in range(args.iters):
            delta = pd_round(prefiller, decoder, f"{n}-{i}", prompt(n))
            if delta.get("nixl_failed_transfers"):
                raise TransferBenchError(f"the READ of a {n}-token prompt failed")
            seconds, nbytes = delta["nixl_transfer_seconds"], delta["nixl_bytes_read"]
            row = {
                "prompt_tokens": n,
                "bytes": int(nbytes),
                "descriptors": int(delta["nixl_descriptors"]),
                "ms": 1000 * seconds,
                "gbps": nbytes / seconds / 1e9,
            }
            logger.info(
                "%d tokens: %.1f MB in %d descriptors, %.1f ms (%.2f GB/s)",
                n, nbytes / MB, row["descriptors"], row["ms"], row["gbps"],
            )  # fmt: skip
            rows.append(row)
    return rows


def pages_of(engine) -> dict[str, int]:
    """The engine's KV memory pages mapped and returned since start (eager: all, none)."""
    memory = engine.stats().kv_memory
    return {"mapped": memory.pages_mapped_total, "returned": memory.pages_returned_total}


def run_connector(args: argparse.Namespace) -> dict:

    from kvferry.engine.core import EngineCore

    prefiller = EngineCore(connector_config(args, "producer", args.prefill_layout))
    try:
        decoder = EngineCore(connector_config(args, "consumer", args.decode_layout))
        try:
            rows = connector_rows(args, prefiller, decoder)
            memory = {"prefill": pages_of(prefiller), "decode": pages_of(decoder)}
        finally:
            decoder.shutdown()
    finally:
        prefiller.shutdown()
    doc = {
        "bench": "transfer_connector",
        "model": args.connector,
        "layouts": {"prefill": args.prefill_layout, "decode": args.decode_layout},
        "kv_allocator": str(args.kv_allocator),
        "kv_pages": memory,
        "iters": args.iters,
        **host_facts(),
        "results": rows,
    }
    save_json(doc, args.output)
    print(json.dumps(doc, indent=2))
    return doc

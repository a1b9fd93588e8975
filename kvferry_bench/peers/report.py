"""The comparison of ``kvferry bench peers``: rows of every engine's figures, kvferry / peer
ratios (vLLM, llama.cpp), the printed table and the PNG."""

from __future__ import annotations

import enum
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

from kvferry_bench.plot import pyplot, save_figure

ENGINES = ("kvferry", "vllm", "llamacpp")
ENGINE_NAMES = {"kvferry": "kvferry", "vllm": "vLLM", "llamacpp": "llama.cpp"}
EVEN = 0.02  # within 2%: neither is ahead


class Peer(enum.Enum):
    """An engine kvferry is compared with; its value is its key in the result documents."""

    VLLM = "vllm"
    LLAMACPP = "llamacpp"

    @property
    def label(self) -> str:
        return ENGINE_NAMES[self.value]


@dataclass(frozen=True)
class Row:
    part: str  # offline | serving | pd
    metric: str
    unit: str
    kvferry: float | None
    vllm: float | None
    higher_is_better: bool
    llamacpp: float | None = None

    def value(self, peer: Peer) -> float | None:
        return self.vllm if peer is Peer.VLLM else self.llamacpp

    def ratio_to(self, peer: Peer) -> float | None:
        """kvferry / `peer` (None when either is missing or the peer's is 0)."""
        theirs = self.value(peer)
        if self.kvferry is None or not theirs:
            return None
        return self.kvferry / theirs

    def ahead_of(self, peer: Peer) -> str:
        """Who is ahead between kvferry and `peer`: kvferry, the peer's name, even or -."""
        ratio = self.ratio_to(peer)
        if ratio is None:
            return "-"
        if abs(ratio - 1.0) <= EVEN:
            return "even"
        return "kvferry" if (ratio > 1.0) == self.higher_is_better else peer.label

    @property
    def ratio(self) -> float | None:
        """kvferry / vLLM."""
        return self.ratio_to(Peer.VLLM)

    @property
    def ahead(self) -> str:
        return self.ahead_of(Peer.VLLM)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "ratio": self.ratio,
            "ahead": self.ahead,
            "ratio_llamacpp": self.ratio_to(Peer.LLAMACPP),
            "ahead_llamacpp": self.ahead_of(Peer.LLAMACPP),
        }


def _per_s(doc: dict | None, workload: str, tokens: str) -> float | None:
    run = (doc or {}).get("workloads", {}).get(workload)
    return run[tokens] / run["seconds"] if run and run["seconds"] > 0 else None


def _seconds(doc: dict | None, workload: str) -> float | None:
    run = (doc or {}).get("workloads", {}).get(workload)
    return run["seconds"] if run else None


def _ms_per_token(doc: dict | None) -> float | None:
    per_s = _per_s(doc, "decode_b1", "generated_tokens")
    return 1000.0 / per_s if per_s else None


def offline_rows(offline: dict, shape: dict) -> list[Row]:
    """Rows from each engine's driver document (`offline[engine]`; missing engines give None)."""
    k, v, ll = (offline.get(engine) for engine in ENGINES)
    tp = f"throughput {shape['num_prompts']}x{shape['input_len']}->{shape['output_len']}"
    decode = f"batch-1 decode {shape['decode_len']} tokens"
    return [
        Row("offline", tp, "gen tok/s", _per_s(k, "throughput", "generated_tokens"),
            _per_s(v, "throughput", "generated_tokens"), True, _per_s(ll, "throughput", "generated_tokens")),
        Row("offline", decode, "gen tok/s", _per_s(k, "decode_b1", "generated_tokens"),
            _per_s(v, "decode_b1", "generated_tokens"), True, _per_s(ll, "decode_b1", "generated_tokens")),
        Row("offline", decode, "ms/token", _ms_per_token(k), _ms_per_token(v), False, _ms_per_token(ll)),
        Row("offline", f"prefill {shape['prefill_len']} tokens", "s",
            _seconds(k, "prefill"), _seconds(v, "prefill"), False, _seconds(ll, "prefill")),
        Row("offline", "engine load (incl. warm-up compile)", "s",
            (k or {}).get("load_s"), (v or {}).get("load_s"), False, (ll or {}).get("load_s")),
    ]  # fmt: skip


SERVING_METRICS = (
    ("output_throughput", "output tok/s", "tok/s", True),
    ("mean_ttft_ms", "mean TTFT", "ms", False),
    ("p99_ttft_ms", "p99 TTFT", "ms", False),
    ("mean_tpot_ms", "mean TPOT", "ms", False),
    ("p99_itl_ms", "p99 ITL", "ms", False),
)


VLLM_TRANSFERRED = "external_kv_transfer"  # vLLM's prompt_tokens_by_source label for pulled KV
PD_METRICS = (
    ("output_throughput", "output tok/s", "tok/s", True),
    ("median_ttft_ms", "p50 TTFT", "ms", False),
    ("p99_ttft_ms", "p99 TTFT", "ms", False),
    ("median_tpot_ms", "p50 TPOT", "ms", False),
    ("p99_tpot_ms", "p99 TPOT", "ms", False),
    ("median_itl_ms", "p50 ITL", "ms", False),
    ("p99_itl_ms", "p99 ITL", "ms", False),
    ("median_e2el_ms", "p50 end-to-end", "ms", False),
    ("p99_e2el_ms", "p99 end-to-end", "ms", False),
)


def serving_rows(serving: dict, part: str = "serving", metrics: tuple = SERVING_METRICS) -> list[Row]:
    """Rows per request rate from each engine's parsed `vllm bench serve` results."""
    by_rate: dict[float, dict[str, dict]] = {}
    for engine in ENGINES:
        for result in serving.get(engine) or []:
            by_rate.setdefault(result["request_rate"], {})[engine] = result
    rows = []
    for rate in sorted(by_rate):
        pair = by_rate[rate]
        for key, name, unit, higher in metrics:
            k, v, ll = (pair.get(engine, {}).get(key) for engine in ENGINES)
            rows.append(Row(part, f"{name} @ {rate:g} req/s", unit, k, v, higher, ll))
    return rows


def pd_rows(pd: dict) -> list[Row]:
    """Rows per request rate of the P/D part: vLLM's P/D and kvferry disagg."""
    return serving_rows(pd, "pd", PD_METRICS)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def shown_peers(rows: list[Row]) -> list[Peer]:
    """The peers with a figure in `rows` (vLLM when none has)."""
    return [p for p in Peer if any(row.value(p) is not None for row in rows)] or [Peer.VLLM]


def format_table(rows: list[Row]) -> str:
    """A fixed-width table: metric, unit, kvferry and each peer, then per peer kvferry / peer
    and who is ahead."""
    peers = shown_peers(rows)
    header = ["part", "metric", "unit", "kvferry", *(p.label for p in peers)]
    for peer in peers:
        header += [f"kvferry/{peer.label}", "ahead"]
    lines = [tuple(header)]
    for row in rows:
        cells = [row.part, row.metric, row.unit, _fmt(row.kvferry), *(_fmt(row.value(p)) for p in peers)]
        for peer in peers:
            ratio = row.ratio_to(peer)
            cells += [f"{ratio:.2f}x" if ratio is not None else "-", row.ahead_of(peer)]
        lines.append(tuple(cells))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def kvferry_speedup(row: Row, peer: Peer = Peer.VLLM) -> float | None:
    """How many times faster kvferry is than `peer` on `row` (>1: kvferry ahead), whatever the unit."""
    ratio = row.ratio_to(peer)
    if ratio is None or ratio <= 0:
        return None
    return ratio if row.higher_is_better else 1.0 / ratio


PLOTTED = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")
PD_PLOTTED = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")


def save_plot(path: Path, rows: list[Row], serving: dict, title: str, pd: dict | None = None) -> bool:
    """A row of offline speedups (bars) and serving metrics vs rate (lines) when those parts
    ran, a row of the P/D part's metrics vs rate when it has results; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    with_pd = any((pd or {}).get(engine) for engine in ENGINES)
    top = any(r.part in ("offline", "serving") for r in rows) or not with_pd
    nrows = int(top) + int(with_pd)
    fig, axes = plt.subplots(nrows, 4, figsize=(20, 4.2 * nrows), squeeze=False)
    if top:
        _offline_bars(axes[0][0], [r for r in rows if r.part == "offline"])
        plotted = [m for m in SERVING_METRICS if m[0] in PLOTTED]
        for ax, (key, name, unit, _) in zip(axes[0][1:], plotted):
            _serving_lines(ax, serving, key, f"serving: {name} ({unit})")
    if with_pd:
        for ax, (key, name, unit, _) in zip(axes[-1], [m for m in PD_METRICS if m[0] in PD_PLOTTED]):
            _serving_lines(ax, pd or {}, key, f"P/D: {name} ({unit})")
    save_figure(fig, path, title)
    return True


def _offline_bars(ax, rows: list[Row]) -> None:
    """Per offline row, one bar per peer: kvferry's speed over the peer's."""
    peers = shown_peers(rows)
    width = 0.8 / len(peers)
    names = [textwrap.fill(f"{row.metric} ({row.unit})", 16) for row in rows]
    for index, (peer, hatch) in enumerate(zip(peers, ("", "//"))):
        values = [kvferry_speedup(row, peer) for row in rows]
        points = [(i + index * width, v) for i, v in enumerate(values) if v is not None]
        if points:
            xs, ys = zip(*points)
            colors = ["#2a7" if y >= 1 else "#c55" for y in ys]
            ax.bar(xs, ys, width, color=colors, hatch=hatch, edgecolor="#333", label=f"vs {peer.label}")
    ax.set_xticks([i + width * (len(peers) - 1) / 2 for i in range(len(rows))], names)
    ax.axhline(1.0, color="#444", linewidth=1)
    if len(peers) > 1:
        ax.legend(fontsize="small")
    ax.set_title("offline: kvferry speed / peer speed")
    ax.set_ylabel(">1: kvferry ahead")
    ax.tick_params(axis="x", labelsize=7)


def _serving_lines(ax, serving: dict, key: str, label: str) -> None:
    """One line per engine; request rates as evenly spaced categories ('inf' has no place on a scale)."""
    rates = sorted({r["request_rate"] for e in ENGINES for r in serving.get(e) or []})
    for engine, color in zip(ENGINES, ("C0", "C1", "C2")):
        results = sorted(serving.get(engine) or [], key=lambda r: r["request_rate"])
        points = [(rates.index(r["request_rate"]), r.get(key)) for r in results if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), "-o", label=ENGINE_NAMES[engine], color=color)
    ax.set_xticks(range(len(rates)), [f"{rate:g}" for rate in rates])
    ax.set_title(label)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")


def pd_summary(pd: dict) -> str:
    """What the P/D part checked and what failed, in a few lines."""
    cores = pd.get("cores", {})
    lines = [f"pd: prefill on cores {cores.get('prefill')}, decode on cores {cores.get('decode')}"]
    probe = (pd.get("vllm_check") or {}).get("probe")
    if probe:
        got = probe["decoder_prompt_tokens"]
        lines.append(
            f"pd: vLLM's decoder got {got.get(VLLM_TRANSFERRED, 0):g} of the probe's "
            f"{probe['prompt_tokens']} prompt tokens by KV transfer ({got.get('local_compute', 0):g} "
            f"computed); greedy answer {'identical to' if probe['identical'] else 'differs from'} "
            f"vLLM colocated (first {probe['common_prefix_chars']} of {len(probe['pd_text'])} chars agree)"
        )
    moved = (pd.get("vllm_check") or {}).get("repinned") or {}
    for name, threads in moved.items():
        if threads:
            was = ", ".join(sorted({t["was"] for t in threads}))
            lines.append(f"pd: {name}: {len(threads)} thread(s) had left its cores (to {was}); put back")
    for engine in ENGINES:
        loads = [x for result in pd.get(engine) or [] for x in result.get("loadavg_1m") or []]
        if loads:
            lines.append(f"pd: 1-minute load average during the {engine} runs: {min(loads):g}-{max(loads):g}")
    for engine in ENGINES:
        if pd.get(engine + "_error"):
            lines.append(f"pd: {engine} failed: {pd[engine + '_error'].splitlines()[0]}")
    return "\n".join(lines)


def token_agreement(offline: dict, peer: str) -> dict | None:
    """Per workload both kvferry and `peer` ran: how many of their first greedy tokens are
    identical (the first prompt's tokens, as the drivers record them); None without `peer`."""
    ours = (offline.get("kvferry") or {}).get("workloads", {})
    theirs = (offline.get(peer) or {}).get("workloads", {})
    if not ours or not theirs:
        return None
    agreement = {}
    for name in ours.keys() & theirs.keys():
        a, b = ours[name].get("tokens"), theirs[name].get("tokens")
        if a is None or b is None:
            continue
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreement[name] = {"identical_prefix": same, "compared": min(len(a), len(b))}
    return agreement


def agreement_summary(agreement: dict, dtype: str) -> str:
    """One line: how far llama.cpp's greedy tokens follow kvferry's on the same ids."""
    parts = [
        f"{name}: first {a['identical_prefix']} of {a['compared']} identical"
        for name, a in sorted(agreement.items())
    ]
    return f"llama.cpp vs kvferry ({dtype}), greedy tokens on the same ids: " + "; ".join(parts)

"""The captured forward: decode steps run as one compiled program.

The model's forward is compiled with torch.compile (inductor; dynamic token count, so one
program serves every decode batch size; a batch of one is padded to two). Attention is the
`kvferry::paged_attention` operator and the connector's per-layer hooks are operators too
(kvferry.model.graph_ops), so the compiled program calls them on every execution with the
step's own ForwardContext. Steps that carry prefill tokens stay eager: their time is in
the GEMMs and attention, which compiling leaves as they are.

How the hooks are captured is decided here, from what the connector declares:
- no per-layer hooks (`has_layer_hooks` False, or no connector): none in the graph;
- `graph_safe`: the hook operators sit inside one full graph (`fullgraph=True`, so a
  break is an error, never a silent fallback);
- otherwise the graph is split at every hook, which runs eagerly between compiled pieces.

On CUDA the program runs under CUDA graphs (`mode="reduce-overhead"`): decode batches
are padded to powers of two (static shapes, one recorded graph per size), and the graph
is cut around the Python operators (tagged `cudagraph_unsafe`). Nothing here has run
on a GPU: its test skips without one.

A compile failure (an unsupported op, no C++ compiler) falls back to eager with one
warning naming the cause.

Whether decode steps keep the compiled program is the engine's decision
(kvferry.engine.capture_choice): --capture auto measures it at start-up, always and
never (--enforce-eager) do not. Every rank is given the same CaptureDecision.

Micro-batching (kvferry.model.microbatch) stays with the eager steps: the compiled
program runs on the whole batch with the OpenMP team. Measured on a 2-core AVX2 EPYC
(SmolLM2 fp32, 64 x 64 tokens): compiled 182 tok/s, compiled per micro-batch thread 151,
eager micro-batched 169.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvferry.config import CaptureMode, CompilationConfig
from kvferry.connector.base import KVConnectorBase
from kvferry.model.forward_context import ForwardContext, HookPlacement
from kvferry.model.graph_ops import cut_compiled_graphs_at_split_hooks

if TYPE_CHECKING:
    from kvferry.model.causal_lm import CausalLM

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

# --capture auto's decision without a compile: a program would run the layers operator by
# operator, and the fused layer (kvferry.model.layers.fused_decode) runs in eager steps only;
# at batch 1 it decodes in about 3/4 of the compiled program's time (docs/benchmarks.md).
FUSED_LAYERS_STAY_EAGER = "not compiled: every decoder layer decodes in one fused call, in eager steps"

# The compiler specializes a batch of one token; decode batches are padded to two so
# that one dynamic-size program serves them all (one compile, not two).
MIN_CAPTURED_TOKENS = 2


def _own_entry(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """`module`'s forward behind a function with a code object of its own.

    The compiler keeps its programs per code object, and every engine's model of one class
    shares its forward's: a process that built engines for 8 differently shaped models
    (a test session, a notebook, a bench comparing models) hit the recompile limit, and a
    full graph then fails to compile (so the engine ran eagerly). An entry per model keeps
    each engine's programs, and their guard checks, to itself."""

    def forward(*args: object) -> torch.Tensor:
        hidden: torch.Tensor = module(*args)
        return hidden

    code = forward.__code__.replace(co_name=f"captured_forward_{id(module):x}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


def keep_compiled_programs_in(cache_dir: str | None) -> None:
    """torch's compile caches (FX graphs, AOT autograd, generated kernels) under kvferry's
    cache directory, so that a later start of the same model on this machine loads the
    decode program rather than generating it. A directory the user chose (in the
    environment) is kept; torch's own default, which importing the compiler writes there
    (a per-user folder in /tmp), is replaced."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if cache_dir is not None and chosen in (None, os.path.abspath(default_cache_dir())):
        os.environ[INDUCTOR_CACHE_ENV] = str(Path(cache_dir) / "inductor")


def floats_specialized() -> contextlib.AbstractContextManager[None]:
    """The compiler's setting for the first call of a captured forward, the call that traces it.

    A dynamic compile (`dynamic=True`) makes every float it reads a symbol: each norm's eps
    and attention's scale, five per layer. The trace then specializes each on its value, and
    a later pass finds symbols it cannot turn into tensors and traces the whole model again.
    Read as the constants they are, they cost neither; the token count stays dynamic.
    Measured on a 2-core AVX2 EPYC, no AVX-512 (2026-11-28, other work on the host, run back
    to back from a cold compile cache): SmolLM2-135M's decode program compiled in 140.0 s
    with two traces (37.8 s + 100.8 s) before, 125.3 s with one after."""
    patch: contextlib.AbstractContextManager[None] = torch._dynamo.config.patch(specialize_float=True)
    return patch


def hook_placement(connector: KVConnectorBase | None) -> HookPlacement:
    """Where the connector's per-layer hooks go (invariant 2)."""
    if connector is None or not connector.has_layer_hooks:
        return HookPlacement.NONE
    return HookPlacement.IN_GRAPH if connector.graph_safe else HookPlacement.SPLIT


def one_row_per_span(ctx: ForwardContext) -> bool:
    """Whether the compiled program takes the step: decode rows, and prefill spans of one
    row only (a prompt's lone last token: after a prefix-cache hit of every block before it,
    a P/D decoder's first step). Such a token is a prefill row for its bits
    (worker/inputs.py) and runs in the program as decodes do; longer prefills run eagerly."""
    return all(span.query_len == 1 for group in ctx.attn for span in group.prefills)


def pad_batch(
    input_ids: torch.Tensor, positions: torch.Tensor, min_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """At least `min_tokens` rows, the last token repeated; attention zeroes the extra rows
    (they are past the metadata's tokens) and every other layer computes rows apart."""
    missing = min_tokens - input_ids.numel()
    if missing <= 0:
        return input_ids, positions
    return (
        torch.cat((input_ids, input_ids[-1:].expand(missing))),
        torch.cat((positions, positions[-1:].expand(missing))),
    )


def cuda_graph_size(num_tokens: int) -> int:
    """The captured CUDA-graph size a decode batch is padded to: the next power of two
    (a bounded set of recorded graphs: static shapes, like static input buffers)."""
    return max(MIN_CAPTURED_TOKENS, 1 << (num_tokens - 1).bit_length())


@dataclass(frozen=True)
class StepTiming:
    """One decode batch size's fastest dummy step, compiled and eager (seconds)."""

    batch_size: int
    compiled_s: float
    eager_s: float

    def describe(self) -> str:
        return (
            f"decode step {1e3 * self.compiled_s:.1f} vs {1e3 * self.eager_s:.1f} ms eager "
            f"at batch {self.batch_size}"
        )


@dataclass(frozen=True)
class CaptureDecision:
    """Whether decode steps run compiled, and why: the mode asked for and, under AUTO,
    what the start-up measurement found."""

    mode: CaptureMode
    compiled: bool
    timings: tuple[StepTiming, ...] = ()
    cached: bool = False  # AUTO: measured by an earlier start (kvferry.engine.capture_cache)
    not_compiled: str | None = None  # AUTO: why no program was compiled to measure (CaptureStats)

    def describe(self) -> str:
        """The start-up log line."""
        return f"captured forward: {'on' if self.compiled else 'off'} ({self._why()})"

    def _why(self) -> str:
        if self.not_compiled is not None:
            return self.not_compiled
        if self.timings:
            measured = "; ".join(t.describe() for t in self.timings)
            return f"cached decision, measured by an earlier start: {measured}" if self.cached else measured
        if self.mode is CaptureMode.NEVER:
            return "--enforce-eager / --capture never"
        if not self.compiled:
            return "the compile failed: see the warning above"
        return f"--capture {self.mode.value}, not measured"


@dataclass
class CaptureStats:
    compiled_steps: int = 0  # forwards run by the compiled program
    eager_steps: int = 0  # forwards run eagerly (prefill, eager mode, or after a fallback)
    compile_seconds: float = 0.0  # time spent in first calls of the compiled program (compiling)
    decision: CaptureDecision | None = None  # the engine's, once made (kvferry.engine.capture_choice)
    not_compiled: str | None = None  # --capture auto decided before compiling: why no program

    def describe(self) -> str:
        return f"captured forward: {self.compiled_steps} forwards compiled, {self.eager_steps} eager"


class CapturedForward:
    """Runs a step's forward compiled (decode-only steps) or eagerly (everything else)."""

    def __init__(
        self,
        model: CausalLM,
        placement: HookPlacement,
        compilation: CompilationConfig,
        device: torch.device,
    ):
        mode = compilation.capture
        self.model = model
        self.placement = placement
        self.cuda_graphs = device.type == "cuda"
        self.stats = CaptureStats()
        self.fallback_reason: str | None = None
        if mode is CaptureMode.AUTO and model.decodes_fused:
            self.stats.not_compiled = FUSED_LAYERS_STAY_EAGER
        never = mode is CaptureMode.NEVER or self.stats.not_compiled is not None
        if not never:
            keep_compiled_programs_in(compilation.cache_dir)
        self._compiled = None if never else self._compile(model, placement, self.cuda_graphs)
        self._compiled_once = False
        self._use_compiled = True  # the engine's decision (use), until it is given

    @staticmethod
    def _compile(model: CausalLM, placement: HookPlacement, cuda_graphs: bool) -> Callable[..., torch.Tensor]:
        """CPU: one inductor program. CUDA: the same, replayed as CUDA graphs between the
        operators tagged `cudagraph_unsafe` (attention, hooks); one graph per padded size.

        On CPU a full-graph program is run without checking the model's modules before each call:
        kvferry loads the weights before the first compile and never changes a module
        afterwards, and those checks (every layer's parameters and attributes) took about
        1 ms of a SmolLM2 decode step (`TorchDynamo Cache Lookup` in torch's profiler:
        0.96 -> 0.07 ms a step, 2026-11-28, 2-core AVX-512 EPYC). The inputs' checks stay
        (token count, dtypes, the step's context). A program split at the connector's hooks
        keeps them: its resumed frames share a code object per position across layers, and
        the module checks are what tell them apart (skipped there, a split engine's greedy
        answers went wrong: tests/test_connector_config.py). The CUDA path keeps them
        (unmeasured)."""
        fullgraph = placement is not HookPlacement.SPLIT
        if not fullgraph:
            cut_compiled_graphs_at_split_hooks()
        entry = _own_entry(model.model)
        if cuda_graphs:
            return torch.compile(entry, fullgraph=fullgraph, dynamic=False, mode="reduce-overhead")
        if not fullgraph:  # frames resumed after the splits: the module checks stay
            return torch.compile(entry, fullgraph=False, dynamic=True)
        options: dict[str, str | int | bool | Callable[..., Any]] = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe
        }
        return torch.compile(entry, fullgraph=True, dynamic=True, options=options)

    @property
    def enabled(self) -> bool:
        """Decode steps run compiled: a program exists and the engine's decision keeps it."""
        return self._compiled is not None and self._use_compiled

    def use(self, decision: CaptureDecision) -> None:
        """Follow the engine's decision (while it measures, a provisional one per step)."""
        self._use_compiled = decision.compiled
        self.stats.decision = decision

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states; with `keep_rows`, those rows only (CausalLM.forward)."""
        num_tokens = input_ids.numel()
        if self.enabled and num_tokens and one_row_per_span(ctx):
            padded = cuda_graph_size(num_tokens) if self.cuda_graphs else MIN_CAPTURED_TOKENS
            hidden = self._run_compiled(*pad_batch(input_ids, positions, padded), ctx)
            if hidden is not None:
                return hidden[:num_tokens] if keep_rows is None else hidden.index_select(0, keep_rows)
        self.stats.eager_steps += 1
        eager: torch.Tensor = self.model(input_ids, positions, ctx, keep_rows)
        return eager

    def _run_compiled(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor | None:
        compiled = self._compiled
        if compiled is None:  # callers check `enabled` first
            return None
        first = not self._compiled_once
        start = time.perf_counter()
        try:
            with floats_specialized() if first else contextlib.nullcontext():
                hidden = compiled(input_ids, positions, ctx)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back, say why
            if not first:
                raise
            self._fall_back(exc)
            return None
        if first:
            self._compiled_once = True
            self.stats.compile_seconds += time.perf_counter() - start
            logger.info(
                "captured forward: decode steps compiled in %.1fs (connector hooks: %s)",
                self.stats.compile_seconds,
                self.placement.value,
            )
        self.stats.compiled_steps += 1
        return hidden

    def _fall_back(self, exc: Exception) -> None:
        self.fallback_reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        logger.warning("captured forward unavailable, running eagerly: %s", self.fallback_reason)
        self._compiled = None

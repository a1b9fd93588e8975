"""Turn the scheduled requests of one step into flat model inputs and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvferry.kv.spec import KVCacheConfig, SlidingWindowSpec
from kvferry.model.forward_context import AttentionMetadata, PrefillSpan
from kvferry.worker.request_state import RequestState


@dataclass(frozen=True)
class RowSpan:
    """Rows [first_row, first_row + length) of a step hold a request's positions start ..
    start + length - 1 (a request's scheduled tokens take one span, or two: see _split)."""

    state: RequestState
    first_row: int
    start: int
    length: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: tuple[AttentionMetadata, ...]  # per KV cache group
    ordered: list[RequestState]  # requests in batch order (decodes first), each once
    spans: list[RowSpan]  # where each request's rows are, in row order
    # token index of each row sampled: a request's last token, then its drafts (a request's
    # sampled rows are consecutive here, whatever their places in the step)
    sample_rows: list[int]
    sample_states: list[RequestState]  # per sampled row: its request
    # per sampled row: its position past the request's known tokens (j for a request's
    # j-th draft row, 0 for every other row)
    sample_offsets: list[int]


@dataclass
class _Span:
    state: RequestState
    start: int  # first position computed this step
    length: int
    drafts: list[int]  # speculative tokens past the request's last one (length counts them)

    @property
    def decodes(self) -> bool:
        """Whether each row attends as a decode: generated tokens (one, or several recomputed
        after a preemption), or a token and its drafts (each row sees the cache up to itself,
        as plain decoding's step would).

        A token is computed as it was first: a prompt token as a prefill row even alone (the
        last one after a prefix-cache hit of every full block before it, a P/D decoder's
        recompute of the prompt's last token, a chunk of one), a generated token as a decode
        row even when recomputed. The decode and prefill kernels sum in different orders, and
        a token's KV must keep its bits, or the tokens after it drift from an undisturbed
        run's (under GGUF's int8 activations, visibly)."""
        return bool(self.drafts) or self.start >= self.state.num_prompt_tokens


def _split(span: _Span) -> list[_Span]:
    """A span of prompt and generated tokens as its prompt rows and its generated rows
    (_Span.decodes): a preempted request recomputed, or a prompt's end and a forced first
    token as its draft (a P/D decoder: the prefiller's token, kvferry.scheduler.drafts)."""
    prompt_len = span.state.num_prompt_tokens
    end = span.start + span.length
    if not span.start < prompt_len < end:
        return [span]
    return [
        _Span(span.state, span.start, prompt_len - span.start, []),
        _Span(span.state, prompt_len, end - prompt_len, span.drafts),
    ]


def _sampled_rows(span: _Span, first_row: int) -> list[tuple[int, int]]:
    """(offset, row) of each row of the span that is sampled: those at or past the
    request's last known token (its last token's row has offset 0, its j-th draft's j)."""
    last_known = len(span.state.token_ids) - 1
    first = max(span.start, last_known)
    return [
        (pos - last_known, first_row + pos - span.start) for pos in range(first, span.start + span.length)
    ]


def build_step_inputs(
    states: list[RequestState],
    num_scheduled: dict[str, int],
    kv_config: KVCacheConfig,
    device: torch.device,
    drafts: dict[str, list[int]] | None = None,
) -> StepInputs:
    """`drafts`: per request, the draft tokens it verifies this step (kvferry.spec_decode)."""
    drafts = drafts or {}
    spans = [
        part
        for s in states
        for part in _split(_Span(s, s.num_computed_tokens, num_scheduled[s.req_id], drafts.get(s.req_id, [])))
    ]
    spans.sort(key=lambda span: not span.decodes)  # decode rows first; stable
    row_spans: list[RowSpan] = []
    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    sampled: dict[int, list[tuple[int, int]]] = {}  # per request (id of its state): (offset, row)
    for span in spans:
        end = span.start + span.length
        row_spans.append(RowSpan(span.state, len(token_ids), span.start, span.length))
        sampled.setdefault(id(span.state), []).extend(_sampled_rows(span, len(token_ids)))
        token_ids.extend(span.state.token_ids[span.start : end - len(span.drafts)])
        token_ids.extend(span.drafts)  # a drafted span: the request's last token, then these
        positions.append(np.arange(span.start, end, dtype=np.int64))
    ordered = list({id(span.state): span.state for span in spans}.values())
    sample_states = [s for s in ordered for _ in sampled[id(s)]]
    offsets_and_rows = [pair for s in ordered for pair in sorted(sampled[id(s)])]
    sample_offsets = [offset for offset, _ in offsets_and_rows]
    sample_rows = [row for _, row in offsets_and_rows]
    flat_positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    split = len(spans) > len(states)
    attn = tuple(
        _group_metadata(spans, flat_positions, gid, kv_config, device, split)
        for gid in range(len(kv_config.groups))
    )
    return StepInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(flat_positions).to(device),
        attn=attn,
        ordered=ordered,
        spans=row_spans,
        sample_rows=sample_rows,
        sample_states=sample_states,
        sample_offsets=sample_offsets,
    )


def _group_metadata(
    spans: list[_Span],
    positions: np.ndarray,
    gid: int,
    kv_config: KVCacheConfig,
    device: torch.device,
    split_requests: bool,
) -> AttentionMetadata:
    spec = kv_config.groups[gid].spec
    block_size = spec.block_size
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0
    slots: list[np.ndarray] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    decode_starts: list[int] = []  # first block a decode's window sees (0: full attention)
    request_starts: list[int] = []  # first decode row of each request
    prefills: list[PrefillSpan] = []
    offset = 0
    for span in spans:
        blocks = np.asarray(span.state.block_ids[gid], dtype=np.int64)
        pos = positions[offset : offset + span.length]
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        seq_len = span.start + span.length
        needed = blocks[: -(-seq_len // block_size)]
        if span.decodes:
            request_starts.append(len(decode_lens))
            for row_len in range(span.start + 1, seq_len + 1):
                first = max(0, row_len - window) // block_size if window else 0
                decode_tables.append(needed[first : -(-row_len // block_size)].tolist())
                decode_lens.append(row_len)
                decode_starts.append(first * block_size)
        else:
            table = torch.from_numpy(needed.copy()).to(device)
            prefills.append(PrefillSpan(offset, span.length, span.start, table))
        offset += span.length
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, np.int64)).to(device),
        num_decodes=len(decode_tables),
        decode_block_table=torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(padded), width),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64, device=device),
        prefills=prefills,
        block_size=block_size,
        decode_start_pos=torch.tensor(decode_starts, dtype=torch.int64, device=device) if window else None,
        decode_request_starts=None if len(request_starts) == len(decode_lens) else tuple(request_starts),
        split_requests=split_requests,
    )

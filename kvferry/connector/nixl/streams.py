"""Prefill side, layer-wise: a streamed prefill is held from the step that completes its prompt.

A request asking for remote decode with a ``transfer_id`` (params.py) and one output token
(what a proxy asks for) is a stream: in the step whose forward computes the rest of its
prompt, the scheduler half sends its hold (blocks final: nothing reallocates them before
the request finishes in that same step) and names it in the step's `streams`, so that each
layer's `save_kv_layer` marks that layer's KV final for decoders. At the request's end the
hold becomes final (`Finish`, with the first token) or, if it did not finish normally, is
released. A request that asks for more tokens is held at its end, as without layer-wise.

Block ids are tracked the way workers build their block tables: a new (or resumed)
request's ids, then each step's appended ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.connector.nixl.params import transfer_id_of
from kvferry.errors import InvalidRequestError
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.scheduler.request import Request


@dataclass
class Stream:
    request: Request
    transfer_id: str
    block_ids: list[list[int]]
    held: bool = False


class PrefillStreams:
    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}

    def add(self, request: Request) -> None:
        """Track a request that streams (invalid params are refused elsewhere, not here)."""
        try:
            transfer_id = transfer_id_of(request.kv_transfer_params)
        except InvalidRequestError:
            return
        if transfer_id is not None and request.sampling_params.max_tokens == 1:
            self.streams[request.req_id] = Stream(request, transfer_id, [])

    def completing(self, output: SchedulerOutput) -> list[Stream]:
        """Streams whose prompt this step completes (each returned once), block ids updated."""
        if not self.streams:
            return []
        computed: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            stream = self.streams.get(new.req_id)
            if stream is not None:
                stream.block_ids = [list(ids) for ids in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            stream = self.streams.get(req_id)
            if stream is None:
                continue
            if new_ids is not None:
                for group, ids in zip(stream.block_ids, new_ids, strict=True):
                    group.extend(ids)
            computed[req_id] = num_computed
        done = []
        for req_id, num_computed in computed.items():
            stream = self.streams[req_id]
            scheduled = output.num_scheduled_tokens.get(req_id, 0)
            if not stream.held and num_computed + scheduled >= stream.request.num_prompt_tokens:
                stream.held = True
                done.append(stream)
        return done

    def pop(self, req_id: str) -> Stream | None:
        return self.streams.pop(req_id, None)

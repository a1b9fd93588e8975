"""P/D request shaping and the non-streamed flow.

One client request becomes one *leg* per prompt (a completions batch is split, since
``kv_transfer_params`` belongs to one request). Each leg: POST the prefill body to a
prefill instance, then the original body plus the prefill's ``kv_transfer_params`` to a
decode instance. The decoder returns the whole answer, so its answer and usage are the
client's answer. Its first token is the prefiller's: the params carry ``first_token_id``
and the decoder outputs that token instead of sampling its own (it still spends the
token's draw, so a seeded answer equals a colocated engine's). That is what lets the
streamed flow send the prefiller's token to the client before the decoder answers, for
sampled requests as much as greedy ones.

A leg that ends with the prefill's answer in hand but no decoder's (the client left, or
the decode leg failed) asks the prefill instance that answered to free the KV it keeps
for the leg (``POST /v1/kv_transfer/release`` with the params' ``remote_request_id``), in
the background, instead of leaving it held until the lease expires. A decoder that did
answer frees it itself (by reading it, or by releasing it when its request is aborted);
the release is idempotent, so one sent while a decoder also had the params is harmless
(a read it cut short is refused by the prefiller, never silently wrong).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvferry.entrypoints.http_common import gather_or_cancel
from kvferry.entrypoints.proxy.failover import DECODER_LOST
from kvferry.entrypoints.proxy.layerwise import can_stream, start_streamed_prefill
from kvferry.entrypoints.proxy.metrics import PrefillPath, ProxyMetrics
from kvferry.entrypoints.proxy.pool import Instance, InstancePool
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex, RouteKey
from kvferry.entrypoints.proxy.prefix_route import PromptHasher
from kvferry.entrypoints.proxy.upstream import Upstream

logger = logging.getLogger(__name__)

T = TypeVar("T")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class ProxyContext:
    """What a request handler needs: pools, the upstream client, metrics, options."""

    prefill: InstancePool
    decode: InstancePool
    upstream: Upstream
    metrics: ProxyMetrics
    early_first_token: bool = True
    prompt_hasher: PromptHasher | None = None  # --policy prefix: a request's block hashes
    prefix_index: PrefixIndex | None = None  # --policy prefix: the instances' cached blocks
    local_prefill_tokens: int = 0  # legs with at most this many uncached tokens skip the prefiller
    # a decoder with nothing in flight prefills while every prefiller is busy
    idle_decoder_prefills: bool = False
    # a leg sent local goes whole to a prefiller with fewer requests in flight than every decoder
    local_on_prefillers: bool = False
    pools: list[InstancePool] = field(init=False)
    background: set[asyncio.Future[Any]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.pools = [self.prefill, self.decode]

    def spawn(self, work: Awaitable[T]) -> asyncio.Future[T]:
        """Run ``work`` outside the calling request (which may be being cancelled)."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def cancel_background(self) -> None:
        tasks = list(self.background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def split_legs(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """One body per prompt: a completions batch (list of strings or token lists) is split."""
    prompt = body.get("prompt")
    if path != COMPLETIONS or not isinstance(prompt, list) or not prompt:
        return [body]
    if all(isinstance(x, int) for x in prompt):
        return [body]  # one prompt given as token ids
    legs = []
    for one in prompt:
        leg = dict(body)
        leg["prompt"] = one
        legs.append(leg)
    return legs


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefiller: one token, not streamed, KV kept for a remote decoder."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if path == CHAT:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    # One answer: the decoder's n children share the prompt's KV it receives (prefix cache);
    # the constraints on the first token (logit_bias, allowed_token_ids, bad_words) stay.
    out.pop("n", None)
    out.pop("best_of", None)
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = min(out["min_tokens"], 1)  # the first token is not EOS
    return out


def answers_per_prompt(body: dict[str, Any]) -> int:
    """The request's n (validated by the proxy's protocol models)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def choice_index(leg: int, answers: int, index: int) -> int:
    """The client's index of answer ``index`` of prompt ``leg`` (``answers`` per prompt), as a
    colocated server numbers a batch's choices: prompt by prompt."""
    return leg * answers + index


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The original request plus the prefill's kv_transfer_params (none: the decoder recomputes).
    A decoder handed the prompt's KV does not compute the prompt: its prompt_logprobs are the
    prefiller's (see ``prefill_prompt_logprobs``)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    params = prefill_response.get("kv_transfer_params")
    if isinstance(params, dict):
        out["kv_transfer_params"] = params
        out.pop("prompt_logprobs", None)
    return out


def prefill_prompt_logprobs(
    path: str, body: dict[str, Any], prefill_response: dict[str, Any]
) -> list[Any] | None:
    """The prompt_logprobs the client asked for, when the prefiller computed them for the
    decoder that will not (it is handed the KV): a completion choice's, or chat's top-level."""
    if body.get("prompt_logprobs") is None or "prompt_logprobs" in decode_body(body, prefill_response):
        return None
    if path == CHAT:
        found = prefill_response.get("prompt_logprobs")
    else:
        found = ((prefill_response.get("choices") or [{}])[0]).get("prompt_logprobs")
    return found if isinstance(found, list) else None


def with_prompt_logprobs(
    path: str, answer: dict[str, Any], prompt_logprobs: list[Any] | None
) -> dict[str, Any]:
    """A decoder's complete answer with the prefiller's prompt_logprobs (vLLM's places: each
    completion choice; chat's response)."""
    if prompt_logprobs is None:
        return answer
    if path == CHAT:
        return {**answer, "prompt_logprobs": prompt_logprobs}
    choices = [{**choice, "prompt_logprobs": prompt_logprobs} for choice in answer.get("choices") or []]
    return {**answer, "choices": choices}


def first_text(path: str, prefill_response: dict[str, Any]) -> str:
    """The text of the prefill's one generated token ("" if it has none)."""
    choices = prefill_response.get("choices") or [{}]
    choice = choices[0]
    if path == CHAT:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def is_greedy(body: dict[str, Any]) -> bool:
    """Greedy decoding: a decoder that recomputes the prompt finds the prefiller's token again."""
    return body.get("temperature") == 0 or body.get("top_k") == 1


def forwards_first_token(prefill_response: dict[str, Any]) -> bool:
    """Whether the decoder gets the prefiller's first token to output as its own."""
    params = prefill_response.get("kv_transfer_params")
    token = params.get("first_token_id") if isinstance(params, dict) else None
    return isinstance(token, int) and not isinstance(token, bool)


def decoder_repeats_first_token(body: dict[str, Any], prefill_response: dict[str, Any]) -> bool:
    """Whether the decoder's answer starts with the prefiller's token: it is handed the token,
    or (no connector: it recomputes the prompt) greedy decoding finds that token again. A
    decoder given KV but not the token (vLLM's NixlConnector) recomputes the last prompt
    token from the transferred KV and samples again: in bf16 not always the same token."""
    if forwards_first_token(prefill_response):
        return True
    return prefill_response.get("kv_transfer_params") is None and is_greedy(body)


def stop_may_cut(text: str, stop: object) -> bool:
    """Whether a stop string could end the answer inside ``text`` (the answer's start): one
    occurs in it, or one may begin in it and finish in later tokens."""
    listed = stop if isinstance(stop, list) else []
    stops = [stop] if isinstance(stop, str) else [s for s in listed if isinstance(s, str)]
    return any(s and (s in text or any(text.endswith(s[:k]) for k in range(1, len(s)))) for s in stops)


def kept_request_id(prefill_response: dict[str, Any]) -> str | None:
    """The prefill instance's id of the request whose KV it keeps for this leg (None: none)."""
    params = prefill_response.get("kv_transfer_params")
    request_id = params.get("remote_request_id") if isinstance(params, dict) else None
    return request_id if isinstance(request_id, str) and request_id else None


def release_abandoned(ctx: ProxyContext, prefill: Prefilled, headers: dict[str, str]) -> None:
    """No decoder answered for this leg: have the prefill instance free the KV it keeps (a
    streamed leg's prefill names it in its own answer, once that comes)."""
    if prefill.answer is not None:
        ctx.spawn(release_when_streamed(ctx, prefill, prefill.answer, headers))
        return
    request_id = kept_request_id(prefill.response)
    if request_id is not None and prefill.instance is not None:
        ctx.spawn(ctx.upstream.release_kv(ctx.prefill, prefill.instance, request_id, headers))


async def release_when_streamed(
    ctx: ProxyContext,
    prefill: Prefilled,
    answer: asyncio.Future[dict[str, Any] | None],
    headers: dict[str, str],
) -> None:
    """A streamed leg nobody decodes: once its prefill answered, release what it keeps."""
    response = await answer
    if response is not None:
        release_abandoned(ctx, Prefilled(prefill.instance, response), headers)


def wants_logprobs(path: str, body: dict[str, Any]) -> bool:
    if path == CHAT:
        return bool(body.get("logprobs"))
    return body.get("logprobs") is not None


@dataclass(frozen=True)
class Prefilled:
    """A prefill's answer and the instance that gave it (which keeps the leg's KV); with no
    instance and an empty answer, the decoder computes the prompt itself (local prefill).
    ``route``: the prompt's blocks, for choosing the decoder too. ``serving``: the pool that
    answers the leg from here (None: the decoders; the prefillers for a local leg one of
    them takes whole)."""

    instance: Instance | None
    response: dict[str, Any]
    route: RouteKey | None = None
    # A streamed (layer-wise) leg: its prefill's own answer, still on the way (None if the
    # prefill failed); ``response`` holds only the params pointing the decoder to it.
    answer: asyncio.Future[dict[str, Any] | None] | None = None
    serving: InstancePool | None = None

    def answering_pool(self, ctx: ProxyContext) -> InstancePool:
        """The pool whose instance computes the rest of the leg (its answer)."""
        return self.serving or ctx.decode


async def run_prefill(
    ctx: ProxyContext, path: str, body: dict[str, Any], headers: dict[str, str]
) -> Prefilled:
    """The prefill's answer. A leg cancelled meanwhile (its client left, another leg of the
    batch failed) leaves the prefill request running: its answer may already be on the way,
    with KV kept for it that only its ``remote_request_id`` can release. The answer is then
    awaited in the background and that KV released (see ``release_when_answered``)."""
    start = time.monotonic()
    route = await route_key(ctx, path, body)
    if prefills_locally(ctx, route):
        if prefiller_takes_local_leg(ctx):
            ctx.metrics.prefill_path(PrefillPath.LOCAL_ON_PREFILLER)
            return Prefilled(None, {}, route, serving=ctx.prefill)
        ctx.metrics.prefill_path(PrefillPath.LOCAL)
        return Prefilled(None, {}, route)
    first = ctx.prefill.acquire(route=route)
    if can_stream(body):
        streamed = await start_streamed_prefill(ctx, first, path, prefill_body(path, body), headers)
        if streamed is not None:
            ctx.metrics.prefill_path(PrefillPath.STREAMED)
            params, answer = streamed
            pointer = {"kv_transfer_params": params, "model": body.get("model"), "created": int(time.time())}
            return Prefilled(first, pointer, route, answer)
    ctx.metrics.prefill_path(PrefillPath.REMOTE)
    work = ctx.upstream.post_json(
        ctx.prefill, path, prefill_body(path, body), headers, route=route, first=first
    )
    task = asyncio.ensure_future(work)
    try:
        inst, response = await asyncio.shield(task)
    except asyncio.CancelledError:
        ctx.spawn(release_when_answered(ctx, task, headers))
        raise
    ctx.metrics.prefill_done(time.monotonic() - start)
    return Prefilled(inst, response, route)


async def route_key(ctx: ProxyContext, path: str, body: dict[str, Any]) -> RouteKey | None:
    """The prompt's block hashes for --policy prefix (tokenized off the event loop); else None."""
    if ctx.prompt_hasher is None:
        return None
    return await asyncio.to_thread(ctx.prompt_hasher.route_key, path, body)


def prefills_locally(ctx: ProxyContext, route: RouteKey | None) -> bool:
    """Per-request disaggregation: the decoder computes the prompt itself, and no KV is
    transferred, when the leg's uncached prompt tokens on the decoder holding most of it
    (by the KV events) are at most --local-prefill-tokens, or (--idle-decoder-prefills)
    when every prefiller has a prefill in flight and a decoder has nothing in flight."""
    return few_uncached_tokens(ctx, route) or (
        ctx.idle_decoder_prefills and prefillers_busy_decoder_idle(ctx)
    )


def prefillers_busy_decoder_idle(ctx: ProxyContext) -> bool:
    """Every healthy prefiller has a prefill in flight, and some healthy decoder nothing:
    the prompt would queue behind another's prefill while a core sits idle."""
    prefillers = [inst for inst in ctx.prefill.instances if inst.healthy]
    decoders = [inst for inst in ctx.decode.instances if inst.healthy]
    return all(inst.in_flight > 0 for inst in prefillers) and any(inst.in_flight == 0 for inst in decoders)


def prefiller_takes_local_leg(ctx: ProxyContext) -> bool:
    """--local-on-prefillers: a leg that skips the transfer is served whole (prefilled and
    decoded) by a prefiller, itself a complete engine, when one has fewer requests in flight
    than every healthy decoder (or no decoder is healthy). Short prompts then use the
    prefillers' cores as a colocated server would, instead of queueing on the decoders."""
    if not ctx.local_on_prefillers:
        return False
    prefillers = [inst.in_flight for inst in ctx.prefill.instances if inst.healthy]
    decoders = [inst.in_flight for inst in ctx.decode.instances if inst.healthy]
    return bool(prefillers) and (not decoders or min(prefillers) < min(decoders))


def few_uncached_tokens(ctx: ProxyContext, route: RouteKey | None) -> bool:
    index = ctx.prefix_index
    if ctx.local_prefill_tokens <= 0 or route is None or index is None:
        return False
    healthy = [inst for inst in ctx.decode.instances if inst.healthy]
    if not healthy:
        return False
    cached = max(index.cached_blocks(inst.url, route.block_hashes) for inst in healthy)
    return route.num_tokens - cached * index.block_size <= ctx.local_prefill_tokens


async def release_when_answered(
    ctx: ProxyContext, task: asyncio.Future[tuple[Instance, dict[str, Any]]], headers: dict[str, str]
) -> None:
    """A cancelled leg's prefill: once it answers, release the KV it kept for the leg."""
    try:
        inst, response = await task
    except asyncio.CancelledError:
        task.cancel()  # the proxy is stopping
        raise
    except Exception as exc:  # no answer: nothing is kept for the leg
        logger.info("the prefill of a cancelled leg failed: %s", exc)
        return
    release_abandoned(ctx, Prefilled(inst, response), headers)


async def run_leg(
    ctx: ProxyContext, path: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    prefill = await run_prefill(ctx, path, body, headers)
    decode = decode_body(body, prefill.response)
    try:
        _, answer = await ctx.upstream.post_json(
            prefill.answering_pool(ctx), path, decode, headers, move_when_lost=False, route=prefill.route
        )
    except DECODER_LOST as exc:
        release_abandoned(ctx, prefill, headers)
        return await fail_over(ctx, path, body, headers, exc)
    except BaseException:  # also a cancellation: the client left
        release_abandoned(ctx, prefill, headers)
        raise
    return with_prompt_logprobs(path, answer, prefill_prompt_logprobs(path, body, prefill.response))


async def fail_over(
    ctx: ProxyContext, path: str, body: dict[str, Any], headers: dict[str, str], exc: Exception
) -> dict[str, Any]:
    """The decoder was lost before answering: the whole request on another one (see failover.py)."""
    if len(ctx.decode.instances) < 2:
        raise exc
    logger.warning("decoder lost (%s); answering on another decoder", exc)
    ctx.metrics.failover(streamed=False)
    retry = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    _, answer = await ctx.upstream.post_json(ctx.decode, path, retry, headers)
    return answer


async def complete(
    ctx: ProxyContext, path: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    """A non-streamed answer: the decoder's, or the decoders' merged for a batch."""
    legs = split_legs(path, body)
    answers = await gather_or_cancel([run_leg(ctx, path, leg, headers) for leg in legs])
    if len(answers) == 1:
        return answers[0]
    return merge_answers(answers)


def merge_answers(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One completions answer from one answer per prompt: choices re-indexed, usage summed."""
    merged = {k: v for k, v in answers[0].items() if k not in ("choices", "usage", "kv_transfer_params")}
    choices = []
    for i, answer in enumerate(answers):
        n = len(answer.get("choices", []))
        for choice in answer.get("choices", []):
            choices.append({**choice, "index": choice_index(i, n, choice.get("index", 0))})
    merged["choices"] = choices
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = sum_usage(usages)
    return merged


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise sum of OpenAI usage objects (nested detail objects too)."""
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, dict):
                total[key] = sum_usage([total.get(key, {}), value])
            elif isinstance(value, int | float):
                total[key] = total.get(key, 0) + value
    return total

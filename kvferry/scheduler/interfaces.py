"""What the scheduler expects from a KV connector's scheduler half: the one statement of
that contract.

Connectors live in kvferry/connector; KVConnectorBase implements this protocol with
do-nothing defaults (a test holds its signatures to these). The scheduler and the engine
core call a connector only when one is configured.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvferry.config import LoadFailurePolicy
from kvferry.messages.kv_connector import KVConnectorOutput, KVTransferParams
from kvferry.messages.scheduler_output import BlockIds, SchedulerOutput
from kvferry.scheduler.request import Request


@runtime_checkable
class SchedulerConnector(Protocol):
    """Scheduler half of a KV connector."""

    @property
    def load_failure_policy(self) -> LoadFailurePolicy:
        """What the scheduler does when loading a request's KV failed (invariant 6)."""
        ...

    def request_added(self, request: Request) -> None:
        """A request was queued (lookups may start before its turn comes).

        A connector whose remote side already produced the request's first output token
        (P/D: the prefiller) calls `request.force_first_token(token)` here, with a token
        in the model's vocabulary.
        """
        ...

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the `num_computed_tokens` local prefix hit that the connector can load.

        Returns (count, load_async). With load_async the request waits in
        WAITING_FOR_REMOTE_KVS until a worker reports it in `finished_recving`; otherwise
        the load happens inside the next forward. The scheduler clamps the count so the
        request's last token is always computed. (None, False): the connector cannot tell
        yet; the request keeps its place and is asked again next step. Raising
        InvalidRequestError fails the request as the client's error (HTTP 400).
        """
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for an admitted request: all its block ids per group.

        The external tokens occupy the positions right after the local prefix hit.
        """
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """Per-step metadata for the worker half. Called for every step, empty ones too."""
        ...

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        """A request finished (any reason). Returns (delay_free, kv_transfer_params).

        With delay_free the scheduler keeps the blocks until a worker reports the request
        in `finished_sending`; kv_transfer_params goes back to the client in the output.
        """
        ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The aggregated KVConnectorOutput of the step, before the scheduler acts on it."""
        ...

    def release_kept(self, request_ids: list[str]) -> None:
        """Nobody will consume the KV kept (delay_free) for these finished requests (their
        client left): free it now, through `finished_sending` as usual. Unknown or already
        released ids are ignored."""
        ...

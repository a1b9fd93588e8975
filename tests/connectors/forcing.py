"""An out-of-tree test connector (loaded by module path): forces each request's first token.

A request whose kv_transfer_params hold ``{"first_token_id": t}`` outputs ``t`` as its first
token, the way the NixlConnector hands a decoder the prefiller's token. It moves no KV.
"""

from __future__ import annotations

from kvferry.connector.base import KVConnectorBase


class ForcingConnector(KVConnectorBase):
    def request_added(self, request):
        token = (request.kv_transfer_params or {}).get("first_token_id")
        if token is not None:
            request.force_first_token(token)

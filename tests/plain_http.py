"""httpx's one-shot calls for plain HTTP to local processes, without TLS set-up.

`httpx.get` and its siblings build a client, and with it an SSL context from the CA bundle,
on every call: about 50 ms of CPU (2026-11-28, AMD EPYC, AVX2), which polling loops paid
several times a second while the servers they waited for started on the same 2 cores.
These build a client without one (verify=False: the tests speak plain HTTP), about 1 ms a
call, and otherwise keep httpx's behaviour: a fresh connection per call."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import httpx


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, verify=False, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, verify=False, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, verify=False, **kwargs)


def stream(method: str, url: str, **kwargs: Any) -> AbstractContextManager[httpx.Response]:
    return httpx.stream(method, url, verify=False, **kwargs)

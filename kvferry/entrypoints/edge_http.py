"""HTTP/1.1 request heads checked byte by byte (RFC 9112) before uvicorn's h11 parses them:
the protocol class the OpenAI server and the P/D proxy give uvicorn (``http=StrictH11Protocol``).

h11 on its own already refuses CR, LF and NUL inside a field value and two Content-Lengths;
it accepts, and this refuses with HTTP 400 (an OpenAI error body, then the connection closes):

- obsolete line folding (a header line starting with SP or HTAB): h11 joins it to the line
  before with a space, which RFC 9112 section 5.2 allows; refusing is the other choice it
  gives, and the one a front end that forwards headers should make;
- both Transfer-Encoding and Content-Length (RFC 9112 section 6.3: "ought to be handled as an
  error", the shape of request smuggling): h11 would frame the body by its chunks;
- control characters (other than HTAB) in a field: h11 passes them to the app.

So a header value (an ``x-request-id`` the proxy forwards, say) never carries a control
character. The check reads only the head: bytes up to the first empty line. A request
pipelined behind another on the same connection, before the first one's answer, is left to
h11's own checks.

Kept free of engine imports so the proxy starts without torch.
"""

from __future__ import annotations

import json
import logging
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvferry.entrypoints.http_common import error_body

logger = logging.getLogger(__name__)

# h11 refuses a head over 16 KiB itself (uvicorn's default h11_max_incomplete_event_size),
# so a head is rescanned at most that long; past this, no more is kept.
MAX_HEAD_BYTES = 64 * 1024
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # CTLs but HTAB; CR/LF only as line ends


def head_problem(head: bytes) -> str | None:
    """Why a request head (its complete lines; a partial last line is ignored) is refused,
    or None. ``head`` may hold just the first lines of a head still arriving."""
    lines = head.split(b"\n")[:-1]  # the last piece has no line end yet
    names: set[bytes] = set()
    for number, line in enumerate(lines):
        line = line.removesuffix(b"\r")
        if not line:
            break  # the end of the head
        if number > 0 and line[:1] in (b" ", b"\t"):
            return "obsolete line folding is not accepted in a request header (RFC 9112 section 5.2)"
        if _CONTROL.search(line):
            return "a request header contains a control character"
        names.add(line.partition(b":")[0].strip().lower())
    if b"transfer-encoding" in names and b"content-length" in names:
        return "a request must not have both Transfer-Encoding and Content-Length (RFC 9112 section 6.3)"
    return None


class StrictH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that refuses, with HTTP 400, a request head ``head_problem``
    names (see the module docstring); every other byte goes to h11 as before."""

    _head = b""

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            head = self._head + data
            end = _HEAD_END.search(head)
            problem = head_problem(head[: end.end()] if end else head)
            if problem is not None:
                self._refuse(problem)
                return
            self._head = b"" if end or len(head) > MAX_HEAD_BYTES else head
        super().data_received(data)

    def _refuse(self, message: str) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.info("refused a request from %s: %s", client, message)
        content = json.dumps(error_body(message, "invalid_request_error")).encode()
        head = (
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(content)
        )
        self.transport.write(head + content)  # by hand: h11 has seen no request to answer
        self.transport.close()

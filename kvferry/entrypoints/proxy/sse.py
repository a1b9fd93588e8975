"""Server-sent events parsed by their own framing (the WHATWG event-stream format).

Lines end with CRLF, LF or CR and nothing else: U+2028, U+2029, U+0085 and the other
characters ``str.splitlines`` (and so httpx's line reader) breaks on may stand inside an
event's JSON. An event ends with a blank line; its ``data:`` lines are joined with LF.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

_EOL = re.compile(r"\r\n|\r|\n")


class SSEDecoder:
    """Incremental: ``feed`` text as it arrives, get the data of every completed event."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        events: list[str] = []
        start = 0
        while True:
            match = _EOL.search(self._buffer, start)
            if match is None or (match.group() == "\r" and match.end() == len(self._buffer)):
                break  # no full line yet (a lone CR at the end may be the start of CRLF)
            self._line(self._buffer[start : match.start()], events)
            start = match.end()
        self._buffer = self._buffer[start:]
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return  # a comment (keep-alive)
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


async def sse_data(text: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each complete event of a decoded text stream."""
    decoder = SSEDecoder()
    async for piece in text:
        for data in decoder.feed(piece):
            yield data

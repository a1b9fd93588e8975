"""A TCP forwarder that records every byte: ``python -m tests.tcp_relay HOST PORT DIR``.

Listens on a free port of 127.0.0.1 (printed on its first line of stdout), forwards each
connection to HOST:PORT and appends what passes to DIR/<n>.up (client to target) and
DIR/<n>.down (target to client). The man in the middle of tests/test_side_channel_relay.py:
it runs until killed.
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path


def _pump(src: socket.socket, dst: socket.socket, record: Path) -> None:
    with open(record, "ab", buffering=0) as out:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            out.write(data)
            try:
                dst.sendall(data)
            except OSError:
                break
    for sock in (src, dst):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def main(host: str, port: int, record_dir: Path) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    print(listener.getsockname()[1], flush=True)
    for n in range(1_000_000):
        client, _ = listener.accept()
        target = socket.create_connection((host, port))
        up, down = record_dir / f"{n}.up", record_dir / f"{n}.down"
        threading.Thread(target=_pump, args=(client, target, up), daemon=True).start()
        threading.Thread(target=_pump, args=(target, client, down), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))

"""Listening ports are chosen where no outgoing connection can take them before their bind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvferry import ports
from kvferry.ports import LOWEST_PORT, PortPicker, ephemeral_start


def test_ports_come_from_below_the_kernels_ephemeral_range_and_never_twice() -> None:
    picker = PortPicker()
    ports = [picker.pick() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(LOWEST_PORT <= port < ephemeral_start() for port in ports)


def test_a_port_something_listens_on_is_skipped() -> None:
    first = PortPicker(seed=7).pick()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", first))
        listener.listen()
        assert PortPicker(seed=7).pick() != first


def test_a_reserved_port_is_never_handed_out_though_it_is_bindable() -> None:
    first = PortPicker(seed=7).pick()
    picker = PortPicker(seed=7)
    picker.reserve(first)
    assert first not in [picker.pick() for _ in range(50)]


def test_the_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("20000\t60999\n")
    picker = PortPicker(range_file)
    assert all(LOWEST_PORT <= picker.pick() < 20000 for _ in range(20))
    assert ephemeral_start(tmp_path / "absent") == 49152


def test_a_range_too_low_to_choose_from_leaves_the_choice_to_the_kernel(tmp_path: Path) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("10100 60999")
    picker = PortPicker(range_file)
    port = picker.pick()
    assert port >= 10100 and port in picker.issued


def test_processes_forked_from_one_point_pick_different_ports() -> None:
    """Engine cores, TP ranks and forked commands start from a parent that already holds the
    picker: each must not repeat the parent's (or a sibling's) next port."""
    parent_next = ports.PORTS.random.getstate()
    reads, writes = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report where its sequence stands, leave at once
        os.write(writes, str(ports.PORTS.random.getstate() != parent_next).encode())
        os._exit(0)
    os.close(writes)
    with os.fdopen(reads) as answer:
        assert answer.read() == "True"
    assert os.waitpid(pid, 0)[1] == 0

"""How a process of kvferry's own ends: without the interpreter's final garbage collections.

On exit the interpreter clears module after module and collects garbage each time; with
torch, transformers and the engine loaded that takes about 2 s of one core (a tiny model's
`kvferry serve` took 2.2-2.4 s from SIGINT to its exit, 0.5-0.7 s with this). Whoever stops
the process waits for it, and a fleet or a test session stops many. Objects frozen before
the exit are out of the collector's reach; reference counts still free them, and exit
handlers still run."""

from __future__ import annotations

import gc


def leave_remaining_objects_to_the_os() -> None:
    """Call as the process's last work: only a program's own entry point, never a library
    function a caller's process goes on from (its later garbage would not be collected)."""
    gc.freeze()

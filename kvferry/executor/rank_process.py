"""A tensor-parallel rank's process: `python -m kvferry.executor.rank_process --fd N`, or
run_rank in a fork of the engine core process (kvferry.executor.rank_start).

Under an in-process LLM, ranks start with subprocess rather than multiprocessing's spawn, which
re-runs the caller's main module in every child: `LLM(model, tensor_parallel_size=2)`
from a script without a `__main__` guard, from `python -c` or from a REPL then failed with
a bootstrap error. Here a rank imports nothing of its caller. It talks to the executor
over one end of a socket pair (inherited fd N): it receives its RankSetup, answers with a
WorkerReply, then runs WorkerCalls until `shutdown`, or until the executor goes away.
"""

from __future__ import annotations

import argparse
import logging
import traceback
from multiprocessing.connection import Connection

from kvferry.executor.rank import RankSetup, WorkerCall, WorkerReply, build_worker
from kvferry.process_exit import leave_remaining_objects_to_the_os
from kvferry.worker.worker import Worker


def serve_calls(worker: Worker, rank: int, conn: Connection) -> None:
    while True:
        try:
            call: WorkerCall = conn.recv()
        except EOFError:  # the executor went away
            return
        try:
            conn.send(WorkerReply(rank, call.run(worker)))
        except Exception:  # noqa: BLE001 - the executor raises it with the rank's traceback
            conn.send(WorkerReply(rank, error=traceback.format_exc()))
        if call.method is Worker.shutdown:
            return


def run_rank(conn: Connection) -> None:
    setup: RankSetup = conn.recv()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rank{setup.rank} %(name)s: %(message)s",
        force=True,  # a forked rank drops its parent's handlers
    )
    try:
        worker = build_worker(setup)
    except Exception:  # noqa: BLE001 - reported to the executor, which fails start-up with it
        conn.send(WorkerReply(setup.rank, error=traceback.format_exc()))
        return
    conn.send(WorkerReply(setup.rank))
    serve_calls(worker, setup.rank, conn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="this rank's end of the executor's socket pair")
    args = parser.parse_args()
    with Connection(args.fd) as conn:
        run_rank(conn)
    leave_remaining_objects_to_the_os()


if __name__ == "__main__":
    main()

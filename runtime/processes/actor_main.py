"""Entry point of an actor's child process: `python -m runtime.processes.actor_main ROLE SPEC_JSON`.

The parent passes everything in argv (never through fork), and holds our stdin open: when it
reads EOF, the parent is gone (or wants us gone), and we exit at once. That is the only way we
stop: SIGTERM and SIGINT are ignored, so that a signal sent to the whole service (systemd's
default KillMode=control-group) lets the parent drain its requests instead of killing us under
them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading

import trio

from runtime.config.engine import EngineConfig

# The API process's log format (runtime/cli/main.py); a child logs at the level its parent's
# root logger had when it spawned it (the spec's "log_level").
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def exit_when_parent_dies(ipc_dir: str | None) -> None:
    def watch() -> None:
        # The raw fd, not sys.stdin: a daemon thread blocked inside a buffered reader aborts
        # the interpreter at exit ("could not acquire lock for <stdin>").
        while os.read(0, 4096):  # b"" only at EOF: the parent closed the pipe or died
            pass
        if ipc_dir is not None:  # a SIGKILLed parent cannot remove our sockets' folder
            shutil.rmtree(ipc_dir, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main() -> None:
    role, spec = sys.argv[1], json.loads(sys.argv[2])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # trio.run leaves an ignored SIGINT alone
    exit_when_parent_dies(spec.get("ipc_dir"))
    logging.basicConfig(level=spec.get("log_level", logging.WARNING), format=LOG_FORMAT)
    config = EngineConfig.from_dict(spec["config"])
    if role == "scheduler":
        from runtime.scheduler.actor import SchedulerActor

        actor = SchedulerActor(config, frozenset(spec["eos_token_ids"]), spec["dp_rank"])
        frontend_address, worker_address = spec["listen"]
        trio.run(actor.serve, frontend_address, worker_address)
    elif role == "worker":
        from runtime.worker.actor import WorkerActor

        worker = WorkerActor(config, spec["progress"], spec["dp_rank"], spec["tp_store"])
        trio.run(worker.serve, spec["dial"])
    elif role == "shard":  # a tensor-parallel rank > 0: no trio, no socket, only its group
        from runtime.worker.shard_follower import follow

        follow(config, spec["tp_rank"], spec["tp_store"])
    else:
        raise SystemExit(f"unknown actor role {role!r}")


if __name__ == "__main__":
    main()

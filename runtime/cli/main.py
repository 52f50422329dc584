"""The `runtime` command: `runtime serve`, `runtime replay` and `runtime make-model`."""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import math
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from runtime.cli.parser import api_key, build_parser
from runtime.config.engine import EngineConfig, parse_size
from runtime.processes import ipc_dir
from runtime.processes.actor_main import LOG_FORMAT

logger = logging.getLogger("runtime")

# After the drain deadline, how long hypercorn may take to finish before we stop waiting for
# it: only a client that stopped reading can hold it up that long (STACK.md §1.4).
HARD_EXIT_GRACE = 3.0


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "make-model":
        from runtime.checkpoints.random_model import make_tiny_model

        print(
            f"wrote {args.arch} checkpoint to {make_tiny_model(args.out_dir, args.arch, args.seed)}"
        )
        return
    if args.command == "replay":
        from runtime.cli.replay import main as replay_main

        sys.exit(replay_main(args))
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("runtime.hypercorn").setLevel(logging.WARNING)
    sockets = bind_or_exit(args.host, args.port)
    try:
        if args.max_open_requests < 1:
            raise ValueError("--max-open-requests must be at least 1")
        if not (math.isfinite(args.request_timeout) and args.request_timeout >= 0):
            raise ValueError("--request-timeout must be positive, or 0 for no limit")
        args.api_key = api_key(args)
        check_control_api(args.enable_control_api, args.api_key, args.host)
        if not args.output_root.is_dir():
            raise ValueError(f"--output-root {args.output_root}: not a folder")
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        config = engine_config(args)
        check_device(config.device)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        trio.run(serve_main, args, config, sockets)
    except* (ValueError, FileNotFoundError) as group:
        for error in leaf_exceptions(group):
            logger.debug("startup failed", exc_info=error)
            logger.error("%s", error)
        sys.exit(2)
    except* Exception as failures:
        for failure in leaf_exceptions(failures):
            logger.error("the server stopped: %r", failure, exc_info=failure)
        sys.exit(1)


def bind_or_exit(host: str, port: int) -> list[socket.socket]:
    """The server's address, bound before anything loads: if it cannot be (a port in use),
    one line and exit 2, rather than a traceback once the model has loaded."""
    from api.http.connections import AddressError, bind_tcp

    try:
        return bind_tcp(host, port)
    except AddressError as exc:
        logger.error("%s", exc)
        sys.exit(2)


def leaf_exceptions(error: BaseException) -> list[BaseException]:
    """The errors themselves, out of the (nested) exception groups nurseries wrap them in."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaf_exceptions(inner)]
    return [error]


def raise_open_file_limit(connections: int) -> None:
    """Each connection is a file descriptor: lift the soft limit (often 1024) toward the hard
    one, as vLLM does, so that --max-connections is what bounds them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256  # the actors' sockets, the model's files, logs, threads
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        logger.warning(
            "--max-connections %d is near the open-file limit %d: accepting may fail first",
            connections,
            target,
        )


def check_control_api(enabled: bool, key: str | None, host: str) -> None:
    """The control API stops generation, loads weights from any path and writes files: with no
    API key, only a loopback address may serve it (and a warning says it is open)."""
    if not enabled or key is not None:
        return
    if not is_loopback(host):
        raise ValueError(
            f"--enable-control-api without an API key would let anyone who reaches {host} "
            "pause the server, load weights and write files: set --api-key-file, or serve on "
            "127.0.0.1"
        )
    logger.warning("the control API is on with no API key: anyone on this machine can use it")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_device(device: str) -> None:
    """Refuse a device torch cannot use here before any actor starts, rather than let the
    worker die on its first tensor."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device {device!r}: {exc}") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise ValueError(f"--device {device!r}: only cpu and cuda are supported")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0 or (parsed.index or 0) >= visible:
        raise ValueError(
            f"--device {device!r}: torch {torch.__version__} sees {visible} CUDA device(s)"
        )


def read_chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: {exc}") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model or "",
        mode=args.mode,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory),
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads,
        max_steps_in_flight=args.max_steps_in_flight,
        max_sessions=args.max_sessions,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        allow_weight_cast=args.allow_weight_cast,
        chat_template=read_chat_template(args.chat_template),
        logprobs_mode=args.logprobs_mode,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        structured_outputs_backend=args.structured_outputs_backend,
        pooling=args.pooling,
        quantization=args.quantization,
    )


async def serve_main(
    args: argparse.Namespace, config: EngineConfig, sockets: list[socket.socket]
) -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_signals, shutdown, args.drain_timeout)
        await run_server(args, config, shutdown, sockets)
        nursery.cancel_scope.cancel()  # stop watching signals


async def run_server(
    args: argparse.Namespace,
    config: EngineConfig,
    shutdown: trio.Event,
    sockets: list[socket.socket],
) -> None:
    """Start the engine, serve until `shutdown`, drain. A signal during startup cancels it."""
    from api.http.connections import ConnectionLimits
    from api.http.request_log import LogConfig
    from api.http.state import ServerSettings
    from api.server import serve
    from runtime.frontend.launch import ACTOR_DEATH_GRACE, open_engine
    from runtime.processes.supervisor import ActorDiedError

    raise_open_file_limit(args.max_connections)
    ready = trio.Event()
    server_stopped = trio.Event()

    async def stop_serving(error: ActorDiedError) -> None:
        """Drain: the failed requests send their errors, hypercorn stops; then the error
        ends the process with status 1, for a process supervisor to restart it."""
        if not ready.is_set():
            return  # nothing is served yet: let the error stop the startup
        logger.error("%s: shutting down", error)
        shutdown.set()
        arm_hard_exit(ACTOR_DEATH_GRACE + HARD_EXIT_GRACE, status=1)
        await server_stopped.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_unless_ready, shutdown, ready, nursery.cancel_scope)
        model, default_name = await served_checkpoint(config.model, config.quantization)
        config = config.replace(model=model)
        async with open_engine(config, progress=True, on_actor_death=stop_serving) as engine:
            name = args.served_model_name or default_name
            settings = ServerSettings(
                served_model_name=name,
                api_key=args.api_key,
                max_open_requests=args.max_open_requests,
                request_timeout=args.request_timeout or None,
                enable_control_api=args.enable_control_api,
                strict_fields=args.strict_fields,
                output_root=args.output_root.resolve(),
                max_body_bytes=int(args.max_body_mb * 2**20),
                cumulative_streaming_output=args.cumulative_streaming_output,
                tool_call_parser=args.tool_call_parser,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                max_embedding_inputs=int(args.max_embedding_inputs),
                log_config=LogConfig(
                    log_requests=args.log_requests,
                    log_requests_level=args.log_requests_level,
                    dump_requests_folder=args.dump_requests_folder,
                    dump_requests_threshold=args.dump_requests_threshold,
                ),
            )
            # server_stopped is set once the server nursery has exited, however it exits
            async with _set_on_exit(server_stopped), trio.open_nursery() as server:
                binds = await server.start(
                    partial(
                        serve,
                        engine,
                        settings,
                        host=args.host,
                        port=args.port,
                        shutdown=shutdown,
                        sockets=sockets,
                        drain_timeout=args.drain_timeout,
                        limits=ConnectionLimits(
                            max_connections=args.max_connections,
                            keep_alive_timeout=args.keep_alive_timeout,
                            send_timeout=args.send_timeout,
                        ),
                    )
                )
                ready.set()
                gc.collect()
                gc.freeze()  # tokenizer, app, engine: long-lived, out of every later GC pass
                url = binds[0]
                logger.info(
                    "serving %s at %s (OpenAI API under %s/v1, playground page at %s/)",
                    *(name, url, url, url),
                )
        nursery.cancel_scope.cancel()


async def _cancel_unless_ready(
    shutdown: trio.Event, ready: trio.Event, scope: trio.CancelScope
) -> None:
    await shutdown.wait()
    if not ready.is_set():
        logger.info("shutdown requested during startup")
        scope.cancel()


async def served_checkpoint(model: str, quantization: str | None = None) -> tuple[str, str]:
    """The checkpoint folder to serve and the name clients use unless told otherwise: the
    default model when none is named, the converted copy of a GGUF file (converted first, on
    first use), before any actor starts."""
    from runtime.checkpoints.default_model import DEFAULT_MODEL_ID, default_model_file
    from runtime.checkpoints.gguf import resolve_checkpoint

    name = Path(model).name.removesuffix(".gguf")
    if not model:
        model, name = str(default_model_file()), DEFAULT_MODEL_ID
        logger.info("no --model: the default model, %s (%s)", name, model)
    resolve = partial(resolve_checkpoint, model, quantization=quantization)
    folder = await trio.to_thread.run_sync(resolve, abandon_on_cancel=True)
    return folder, name


async def watch_signals(shutdown: trio.Event, drain_timeout: float) -> None:
    """First SIGTERM/SIGINT: drain, with a hard-exit watchdog. A second one: exit now."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if shutdown.is_set():
                logger.warning("second signal: exiting now")
                ipc_dir.remove_all()  # no `finally` runs past os._exit
                os._exit(1)  # children see their stdin close and exit too
            logger.info("%s: shutting down", signal.Signals(signum).name)
            shutdown.set()
            arm_hard_exit(drain_timeout + HARD_EXIT_GRACE, status=0)


def arm_hard_exit(seconds: float, status: int) -> None:
    """Exit after `seconds` even if hypercorn is stuck in a shielded send to a client that
    stopped reading (STACK.md §1.4), which no cancellation can interrupt."""
    timer = threading.Timer(seconds, _hard_exit, args=(status,))
    timer.daemon = True
    timer.start()


def _hard_exit(status: int) -> None:
    logger.warning("shutdown is stuck (a client stopped reading?): exiting anyway")
    logging.shutdown()
    ipc_dir.remove_all()  # no `finally` runs past os._exit
    os._exit(status)


@asynccontextmanager
async def _set_on_exit(event: trio.Event) -> AsyncIterator[None]:
    try:
        yield
    finally:
        event.set()


if __name__ == "__main__":
    main()

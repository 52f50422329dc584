"""Start the engine: the actors (processes or tasks), then the frontend `Engine` on top.

async with open_engine(EngineConfig(model="path/to/checkpoint")) as engine:
    ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from functools import partial

import trio
from transformers import AutoTokenizer

from runtime.checkpoints.gguf import resolve_checkpoint
from runtime.checkpoints.model_info import load_model_info, resolve_max_model_len
from runtime.config.engine import EngineConfig
from runtime.frontend.data_parallel import DataParallelChannel
from runtime.frontend.engine import Engine
from runtime.processes.supervisor import ActorDiedError, OnDeath, start_actors
from runtime.protocol import EngineDeadError
from runtime.wire.transport import MessageChannel

# Seconds the requests of a dead engine (and `on_actor_death`) get to report the error.
ACTOR_DEATH_GRACE = 5.0


@asynccontextmanager
async def open_engine(
    config: EngineConfig, *, progress: bool = False, on_actor_death: OnDeath | None = None
) -> AsyncIterator[Engine]:
    """Start the scheduler and worker actors (processes or tasks, per `config.mode`).

    If an actor process dies, every request fails with EngineDeadError, `on_actor_death` (if
    given) is awaited, e.g. to let an HTTP server send those errors and stop, and then
    ActorDiedError cancels everything: within ACTOR_DEATH_GRACE seconds in all.
    """
    resolve = partial(resolve_checkpoint, config.model, quantization=config.quantization)
    model = await trio.to_thread.run_sync(resolve, abandon_on_cancel=True)
    config = config.replace(model=model)  # a GGUF file's converted copy, or the folder itself
    info = load_model_info(config)
    config = config.replace(max_model_len=resolve_max_model_len(config, info))
    tokenizer = await trio.to_thread.run_sync(AutoTokenizer.from_pretrained, config.model)
    engine: Engine | None = None  # set once it runs: a death during startup has nobody to tell

    async def report_death(error: ActorDiedError) -> None:
        """Shielded: even if the engine's user leaves meanwhile, the death is raised after."""
        if engine is None:
            return
        engine.fail(error)
        with trio.move_on_after(ACTOR_DEATH_GRACE, shield=True):
            await engine.wait_no_requests()
            if on_actor_death is not None:
                await on_actor_death(error)

    async with trio.open_nursery() as actors:
        channels, processes = await start_actors(
            actors, config, info.eos_token_ids, progress, report_death
        )
        with ExitStack() as closing:  # closed only once the tasks using them have exited
            for each in channels:
                closing.enter_context(each)
            channel: MessageChannel = channels[0]
            groups = None
            if len(channels) > 1:
                channel = groups = DataParallelChannel(channels, config.block_size)
            starting = Engine(config, info, tokenizer, processes, groups)
            async with trio.open_nursery() as frontend:
                if groups is not None:
                    await frontend.start(groups.run)
                await frontend.start(starting.run, channel)
                engine = starting
                try:
                    yield engine
                finally:
                    engine.fail(EngineDeadError("the engine shut down"))
                    frontend.cancel_scope.cancel()
        actors.cancel_scope.cancel()

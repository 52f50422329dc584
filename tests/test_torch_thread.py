"""The worker's one torch thread: every job on the same OS thread, in order, as
trio.to_thread.run_sync behaves for errors and cancellation."""

from __future__ import annotations

import threading

import pytest
import trio

from runtime.worker.torch_thread import TorchThread


async def test_jobs_run_in_order_on_one_thread() -> None:
    torch_thread = TorchThread()
    ran: list[tuple[int, int]] = []

    def job(i: int) -> int:
        ran.append((i, threading.get_ident()))
        return i * i

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(torch_thread.run, job, i)
            await trio.lowlevel.checkpoint()  # queued in this order
    assert [i for i, _ in ran] == list(range(20))
    assert len({ident for _, ident in ran}) == 1
    assert ran[0][1] != threading.get_ident()
    assert await torch_thread.run(job, 7) == 49
    await torch_thread.close()


async def test_an_error_reaches_the_caller_and_the_thread_serves_on() -> None:
    torch_thread = TorchThread()

    def fail() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        await torch_thread.run(fail)
    assert await torch_thread.run(lambda: "next") == "next"
    await torch_thread.close()


async def test_a_cancelled_caller_waits_for_its_job() -> None:
    torch_thread = TorchThread()
    release = threading.Event()
    finished = []

    def slow() -> str:
        release.wait()
        finished.append(True)
        return "done"

    with trio.CancelScope() as scope:
        scope.cancel()
        trio.lowlevel.current_trio_token().run_sync_soon(release.set)
        result = await torch_thread.run(slow)
    assert result == "done" and finished == [True]  # it ran to its end before returning
    await torch_thread.close()


async def test_an_abandoned_job_runs_on_and_later_jobs_wait_for_it() -> None:
    torch_thread = TorchThread()
    release = threading.Event()
    order: list[str] = []

    def stuck() -> None:
        release.wait()
        order.append("stuck")

    with trio.move_on_after(0.05) as scope:
        await torch_thread.run(stuck, abandon_on_cancel=True)
    assert scope.cancelled_caught and order == []  # the caller left; the job did not end
    release.set()
    await torch_thread.run(order.append, "after")
    assert order == ["stuck", "after"]
    await torch_thread.close()


async def test_close_waits_for_the_thread_to_let_go_of_its_last_job() -> None:
    """Freed on the torch thread before close returns, never during interpreter shutdown."""
    torch_thread = TorchThread()
    freed = threading.Event()

    class Model:
        def __del__(self) -> None:
            freed.set()

    model = Model()
    await torch_thread.run(lambda m: None, model)
    del model  # the thread's last job may now hold its last reference
    with trio.CancelScope() as scope:
        scope.cancel()  # an actor shutting down: close is shielded
        await torch_thread.close()
    assert freed.is_set() and not torch_thread._thread.is_alive()


async def test_close_gives_up_on_a_job_that_never_returns() -> None:
    torch_thread = TorchThread()
    release = threading.Event()
    with trio.move_on_after(0.05):
        await torch_thread.run(release.wait, abandon_on_cancel=True)
    await torch_thread.close(grace=0.05)
    assert torch_thread._thread.is_alive()
    release.set()

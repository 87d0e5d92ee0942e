import asyncio
import threading

import pytest

from engine.swarm.compute_thread import ComputeThread


def test_calls_run_in_order_on_one_thread_that_is_not_the_loop():
    ct = ComputeThread()
    seen = []

    async def main():
        loop_thread = threading.get_ident()
        results = await asyncio.gather(*(ct.run(lambda i=i: (seen.append(i), threading.get_ident())[1])
                                         for i in range(20)))
        return loop_thread, set(results)

    loop_thread, threads = asyncio.run(main())
    ct.stop()
    assert seen == list(range(20))
    assert len(threads) == 1 and loop_thread not in threads


def test_exceptions_reach_the_awaiting_coroutine():
    ct = ComputeThread()

    def boom():
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        asyncio.run(ct.run(boom))
    assert asyncio.run(ct.run(lambda: 7)) == 7
    ct.stop()


def test_background_calls_wait_until_no_other_call_waits():
    """Generation steps (background) queued first still run after a training call queued later."""
    ct, gate, seen = ComputeThread(), threading.Event(), []

    async def main():
        blocker = asyncio.wrap_future(ct.submit(gate.wait))  # holds the thread while the others queue
        await asyncio.sleep(0.05)
        calls = [ct.submit_background(seen.append, "gen-1"), ct.submit_background(seen.append, "gen-2"),
                 ct.submit(seen.append, "train"), ct.submit_background(seen.append, "gen-3"),
                 ct.submit(seen.append, "apply")]  # all queued while the thread is held
        gate.set()
        await asyncio.gather(blocker, *map(asyncio.wrap_future, calls))

    asyncio.run(main())
    ct.stop()
    assert seen == ["train", "apply", "gen-1", "gen-2", "gen-3"]

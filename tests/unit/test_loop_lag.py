"""utils/loop_lag.py: a callback that holds the event loop shows up as lateness."""

import asyncio
import time

from slipstream.utils.loop_lag import LoopLag


def test_a_blocked_loop_shows_as_lag_and_the_metrics_reset():
    async def scenario() -> tuple[dict, dict, dict]:
        lag = LoopLag(interval_s=0.002)
        task = asyncio.ensure_future(lag.run())
        await asyncio.sleep(0.05)
        quiet = lag.take_metrics("orchestrator")
        time.sleep(0.2)  # holds the loop, as synchronous work in a coroutine does
        await asyncio.sleep(0.01)
        blocked = lag.take_metrics("orchestrator")
        task.cancel()
        return quiet, blocked, lag.take_metrics("orchestrator")

    quiet, blocked, after = asyncio.run(scenario())
    assert quiet["orchestrator/loop_lag_max_ms"] < 100, quiet
    assert blocked["orchestrator/loop_lag_max_ms"] >= 190, blocked
    assert blocked["orchestrator/loop_lag_mean_ms"] <= blocked["orchestrator/loop_lag_max_ms"]
    assert after == {}

"""`StepOrder`: the shard hands steps to its forward thread in step_id order, whatever
order their calls are handled in (with asynchronous scheduling the router sends step
N + 1 while N runs)."""

from __future__ import annotations

import asyncio

import pytest
from cadence.shard import server
from cadence.shard.server import StepOrder


async def _step(order: StepOrder, step_id: int, delay: float, log: list[int]) -> None:
    await asyncio.sleep(delay)
    await order.wait_turn(step_id)
    log.append(step_id)
    order.handed_over(step_id)


def test_a_step_handled_before_its_predecessor_waits_for_it():
    async def scenario() -> list[int]:
        order, log = StepOrder(), []
        order.handed_over(4)
        await asyncio.gather(_step(order, 6, 0.0, log), _step(order, 5, 0.02, log))
        return log

    assert asyncio.run(scenario()) == [5, 6]


def test_the_first_step_and_steps_in_order_never_wait():
    async def scenario() -> list[int]:
        order, log = StepOrder(), []
        for i in (17, 18, 19):
            await asyncio.wait_for(_step(order, i, 0.0, log), timeout=0.5)
        return log

    assert asyncio.run(scenario()) == [17, 18, 19]


def test_clear_cache_releases_a_waiting_step(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(server, "STEP_ORDER_TIMEOUT_S", 30.0)

    async def scenario() -> list[int]:
        order, log = StepOrder(), []
        order.handed_over(4)
        waiting = asyncio.create_task(_step(order, 9, 0.0, log))
        await asyncio.sleep(0.02)
        assert log == []
        order.reset()
        await asyncio.wait_for(waiting, timeout=1.0)
        return log

    assert asyncio.run(scenario()) == [9]


def test_a_step_whose_predecessor_never_comes_runs_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(server, "STEP_ORDER_TIMEOUT_S", 0.05)

    async def scenario() -> list[int]:
        order, log = StepOrder(), []
        order.handed_over(4)
        await asyncio.wait_for(_step(order, 6, 0.0, log), timeout=2.0)
        return log

    assert asyncio.run(scenario()) == [6]

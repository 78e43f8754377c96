"""One Steps stream of the shard: a session of steps, each queued on the forward thread
as soon as it is read.

The stream carries the steps in the order the router sent them, so nothing waits for
anything: with asynchronous scheduling the router sends step N + 1 while N runs, and
N + 1 is queued on the forward thread right behind N. A step whose id does not follow the
previous one (a router bug: its diff would apply to the wrong state) is answered with an
error and not run; a step the engine rejects or fails is answered with its error. Either
way the session goes on with the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor

from loguru import logger

from cadence.pb import shard_pb2
from cadence.shard.engine import Engine, NotReadyError
from cadence.shard.step_checks import StepError


def failed(step_id: int, error: str) -> shard_pb2.StepAnswer:
    return shard_pb2.StepAnswer(step_id=step_id, error=error)


class StepSession:
    """The steps of one stream. A session opened later replaces it: steps it reads from
    then on are refused, since the newer session has dropped the state they build on."""

    def __init__(self, engine: Engine, executor: Executor) -> None:
        self.engine = engine
        self.executor = executor
        self.last: int | None = None  # id of the last step queued
        self.replaced = False

    async def answer(
        self, requests: AsyncIterator[shard_pb2.StepRequest]
    ) -> AsyncIterator[shard_pb2.StepAnswer]:
        """The answers to `requests`, in their order. Reading is apart from answering: a
        step is queued the moment it arrives, not once the answer before it is written."""
        answers: asyncio.Queue[asyncio.Future[shard_pb2.StepAnswer] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in requests:
                    answers.put_nowait(self.submit(request))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
        finally:
            reader.cancel()

    def submit(self, request: shard_pb2.StepRequest) -> asyncio.Future[shard_pb2.StepAnswer]:
        """The answer to `request`: queued on the forward thread now, behind every step
        before it, or given at once when the step cannot run."""
        step_id = request.step_id
        if self.replaced:
            return _done(failed(step_id, f"step {step_id}: a newer Steps stream replaced this one"))
        if self.last is not None and step_id != self.last + 1:
            error = f"step {step_id} out of order: step {self.last + 1} comes next"
            logger.warning(f"{error}; not run")
            return _done(failed(step_id, error))
        self.last = step_id
        return asyncio.get_running_loop().run_in_executor(self.executor, self._run, request)

    def _run(self, request: shard_pb2.StepRequest) -> shard_pb2.StepAnswer:
        """On the forward thread; every failure becomes the step's answer (the shard must
        stay up)."""
        step_id = request.step_id
        try:
            return shard_pb2.StepAnswer(step_id=step_id, response=self.engine.step(request))
        except StepError as e:
            logger.bind(request_id=e.request_id).warning(f"step {step_id} rejected: {e}")
            return failed(step_id, f"step {step_id} rejected: {e}")
        except NotReadyError as e:
            return failed(step_id, f"step {step_id}: {e}")
        except Exception as e:
            logger.exception(f"step {step_id} failed")
            return failed(step_id, f"step {step_id} failed: {type(e).__name__}: {e}")


def _done(answer: shard_pb2.StepAnswer) -> asyncio.Future[shard_pb2.StepAnswer]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(answer)
    return future

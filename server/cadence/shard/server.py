"""The shard's gRPC server (grpc.aio) on a unix socket.

The forward runs off the event loop in a single-thread executor, so `Health` answers
while a long Step runs and Steps, Warmup and ClearCache stay strictly ordered. Steps
reach that thread in `step_id` order: with asynchronous scheduling the router sends step
N + 1 while N runs, and two calls are not guaranteed to be handled in the order they were
sent. A bad Step becomes a gRPC error with a clear message; the shard keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import torch.distributed as dist
from loguru import logger

from cadence.config import ShardConfig
from cadence.pb import shard_pb2, shard_pb2_grpc
from cadence.shard.engine import Engine, NotReadyError, init_distributed
from cadence.shard.state import StepError

MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

T = TypeVar("T")

# How long a step waits for the one before it before running anyway (that one was
# cancelled by the router after a failure, or never sent).
STEP_ORDER_TIMEOUT_S = 2.0


class StepOrder:
    """Hands steps to the forward thread in `step_id` order: a step whose predecessor has
    not been handed over yet waits for it (up to STEP_ORDER_TIMEOUT_S)."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.waiters: dict[int, asyncio.Future[None]] = {}

    async def wait_turn(self, step_id: int) -> None:
        if self.last is None or step_id <= self.last + 1:
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiters[step_id] = turn
        try:
            await asyncio.wait_for(turn, STEP_ORDER_TIMEOUT_S)
        except TimeoutError:
            logger.warning(f"step {step_id}: step {step_id - 1} never came; running it anyway")
        finally:
            self.waiters.pop(step_id, None)

    def handed_over(self, step_id: int) -> None:
        self.last = step_id
        turn = self.waiters.pop(step_id + 1, None)
        if turn is not None and not turn.done():
            turn.set_result(None)

    def reset(self) -> None:
        """After ClearCache the router starts over: no step waits for an earlier one."""
        self.last = None
        for turn in self.waiters.values():
            if not turn.done():
                turn.set_result(None)
        self.waiters.clear()


class ShardServicer(shard_pb2_grpc.ShardServicer):
    def __init__(self, engine: Engine, executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.executor = executor
        self.order = StepOrder()

    async def _run(self, context: grpc.aio.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        """Runs `fn` on the forward thread; failures become gRPC errors."""
        return await self._result(context, what, self._submit(fn))

    def _submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queues `fn` on the forward thread now (in call order)."""
        return asyncio.get_running_loop().run_in_executor(self.executor, fn)

    async def _result(
        self, context: grpc.aio.ServicerContext, what: str, future: asyncio.Future[T]
    ) -> T:
        try:
            return await future
        except StepError as e:
            logger.warning(f"{what} rejected: {e}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} rejected: {e}")
        except NotReadyError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:  # the shard must stay up
            logger.exception(f"{what} failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # abort() raises

    async def Info(
        self, request: shard_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.InfoResponse:
        return self.engine.info()

    async def Health(
        self, request: shard_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.HealthResponse:
        e = self.engine
        return shard_pb2.HealthResponse(
            ready=e.ready,
            computed_tokens_total=e.computed_tokens_total,
            prompt_tokens_computed_total=e.prompt_tokens_computed_total,
        )

    async def Warmup(
        self, request: shard_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.WarmupResponse:
        r = request
        return await self._run(
            context,
            "warmup",
            lambda: self.engine.warmup(
                r.max_batch_tokens, r.max_batch_size, r.kv_cache_bytes, r.memory_fraction
            ),
        )

    async def Step(
        self, request: shard_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.StepResponse:
        await self.order.wait_turn(request.step_id)
        running = self._submit(lambda: self.engine.step(request))
        self.order.handed_over(request.step_id)
        return await self._result(context, f"step {request.step_id}", running)

    async def ClearCache(
        self, request: shard_pb2.ClearCacheRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ClearCacheResponse:
        self.order.reset()
        await self._run(context, "clear_cache", self.engine.clear_cache)
        return shard_pb2.ClearCacheResponse()


def _remove_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def serve_async(cfg: ShardConfig, stop: asyncio.Event | None = None) -> None:
    """Loads the model, listens on `unix://<uds_path>` until `stop` is set (or SIGTERM /
    SIGINT arrives), then shuts down and removes the socket."""
    init_distributed(cfg)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard{cfg.rank}-forward")
    # Every torch computation happens on the forward thread, loading included: a second
    # thread that ran torch work would own a second OpenMP team, and with more OpenMP
    # threads than cores libgomp stops spin-waiting, which made each decode step ~40%
    # slower (kernels/engine_step_profile.py with and without a main-thread team).
    engine = await asyncio.get_running_loop().run_in_executor(executor, Engine, cfg)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    shard_pb2_grpc.add_ShardServicer_to_server(ShardServicer(engine, executor), server)
    Path(cfg.uds_path).parent.mkdir(parents=True, exist_ok=True)
    _remove_socket(cfg.uds_path)  # stale, from a process that did not clean up
    server.add_insecure_port(f"unix://{cfg.uds_path}")
    await server.start()
    logger.info(f"shard {cfg.rank} listening on {cfg.uds_path}")

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread: the caller stops us through `stop`
    try:
        await stop.wait()
    finally:
        logger.info(f"shard {cfg.rank} stopping")
        await server.stop(grace=1.0)
        executor.shutdown(wait=False, cancel_futures=True)
        _remove_socket(cfg.uds_path)
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(cfg: ShardConfig) -> None:
    """Runs one shard until SIGTERM/SIGINT (blocking). Used by `cadence serve`."""
    asyncio.run(serve_async(cfg))

"""The shard's gRPC server (grpc.aio) on a unix socket.

The forward runs off the event loop in a single-thread executor, so `Health` answers
while a long step runs, and Warmup and the steps stay strictly ordered. Steps come on one
bidirectional stream, a session (`steps.StepSession`): opening it drops every request's
state, and its steps reach the forward thread in the order they were sent. A bad step is
answered with a clear error; the shard keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import torch.distributed as dist
from loguru import logger

from cadence.config import ShardConfig
from cadence.heartbeat import HEARTBEAT
from cadence.pb import shard_pb2, shard_pb2_grpc
from cadence.shard import faults
from cadence.shard.adapters import AdapterRefused
from cadence.shard.engine import Engine, init_distributed
from cadence.shard.steps import StepSession

MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

T = TypeVar("T")


class ShardServicer(shard_pb2_grpc.ShardServicer):
    def __init__(
        self, engine: Engine, executor: ThreadPoolExecutor, loader: ThreadPoolExecutor
    ) -> None:
        """`executor`: the forward thread; `loader`: where LoRA adapters are parsed, beside
        the steps."""
        self.engine = engine
        self.executor = executor
        self.loader = loader
        self.session: StepSession | None = None

    async def _run(self, context: grpc.aio.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        """Runs `fn` on the forward thread; failures become gRPC errors."""
        try:
            return await self._submit(fn)
        except Exception as e:  # the shard must stay up
            logger.exception(f"{what} failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(e).__name__}: {e}")
        raise AssertionError("unreachable")  # abort() raises

    def _submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queues `fn` on the forward thread now (in call order)."""
        return asyncio.get_running_loop().run_in_executor(self.executor, fn)

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
            computed_tokens_total=e.steps.counts.computed_tokens,
            prompt_tokens_computed_total=e.steps.counts.prompt_tokens,
            heartbeats=HEARTBEAT.beats,
        )

    async def Warmup(
        self, request: shard_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.WarmupResponse:
        r = request
        return await self._run(
            context,
            "warmup",
            lambda: self.engine.warmup(
                r.max_batch_tokens,
                r.max_batch_size,
                r.kv_cache_bytes,
                r.memory_fraction,
                r.replicas,
                r.swap_blocks,
            ),
        )

    async def LoadAdapter(
        self, request: shard_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.LoadAdapterResponse:
        adapters = self.engine.adapters
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self.loader, adapters.load, request.name, request.path
            )
        except AdapterRefused as e:
            logger.warning(f"LoadAdapter refused: {e}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # the shard must stay up
            logger.exception(f"LoadAdapter {request.name} failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, f"LoadAdapter failed: {type(e).__name__}: {e}"
            )
        raise AssertionError("unreachable")  # abort() raises

    async def DropAdapter(
        self, request: shard_pb2.DropAdapterRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.DropAdapterResponse:
        self.engine.adapters.drop(request.name)
        return shard_pb2.DropAdapterResponse()

    async def Steps(
        self,
        requests: AsyncIterator[shard_pb2.StepRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[shard_pb2.StepAnswer]:
        if self.session is not None:
            self.session.replaced = True
        session = self.session = StepSession(self.engine, self.executor)
        # Queued behind the replaced session's steps still to run, ahead of this one's.
        await self._submit(self.engine.clear_cache)
        async for answer in session.answer(requests):
            yield answer


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
    # slower (benchmarks/kernels/engine_step_profile.py with and without a main-thread team).
    engine = await asyncio.get_running_loop().run_in_executor(executor, Engine, cfg)
    faults.install(engine, os.environ)  # the readiness tests' wedged forward, when asked
    # parses LoRA adapters (file reads, small tensor work) off the forward thread
    loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard{cfg.rank}-adapters")
    server = grpc.aio.server(options=GRPC_OPTIONS)
    servicer = ShardServicer(engine, executor, loader)
    shard_pb2_grpc.add_ShardServicer_to_server(servicer, server)
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
        loader.shutdown(wait=False, cancel_futures=True)
        _remove_socket(cfg.uds_path)
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(cfg: ShardConfig) -> None:
    """Runs one shard until SIGTERM/SIGINT (blocking). Used by `cadence serve`."""
    asyncio.run(serve_async(cfg))

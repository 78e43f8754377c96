"""A small synchronous client of one shard, for the tests and tools (the router has its
own, in Rust)."""

from __future__ import annotations

import queue
import time

import grpc

from cadence.pb import shard_pb2, shard_pb2_grpc
from cadence.shard.server import GRPC_OPTIONS


class StepFailed(RuntimeError):
    """A step answered with an error."""

    def __init__(self, step_id: int, error: str) -> None:
        super().__init__(error)
        self.step_id = step_id


class StepStream:
    """One Steps stream, a session: opening it drops every request's state on the shard.
    Steps may be sent ahead of reading their answers, which come back in order."""

    def __init__(self, stub: shard_pb2_grpc.ShardStub, timeout: float | None) -> None:
        self._outbox: queue.SimpleQueue[shard_pb2.StepRequest | None] = queue.SimpleQueue()
        self._answers = stub.Steps(iter(self._outbox.get, None), timeout=timeout)

    def send(self, request: shard_pb2.StepRequest) -> None:
        self._outbox.put(request)

    def answer(self) -> shard_pb2.StepAnswer:
        """The answer to the oldest step sent and not answered yet."""
        return next(self._answers)

    def step(self, request: shard_pb2.StepRequest) -> shard_pb2.StepResponse:
        """Sends `request` and waits for its answer; an error answer raises StepFailed."""
        self.send(request)
        answer = self.answer()
        if answer.WhichOneof("outcome") == "error":
            raise StepFailed(answer.step_id, answer.error)
        return answer.response

    def close(self) -> None:
        """Ends the stream once the steps sent are answered."""
        self._outbox.put(None)

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardClient:
    def __init__(self, uds_path: str, timeout: float | None = None) -> None:
        """`timeout`: deadline in seconds for every call, a whole Steps stream included
        (None: no deadline)."""
        self.uds_path = uds_path
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{uds_path}", options=GRPC_OPTIONS)
        self.stub = shard_pb2_grpc.ShardStub(self.channel)

    def info(self) -> shard_pb2.InfoResponse:
        return self.stub.Info(shard_pb2.InfoRequest(), timeout=self.timeout)

    def health(self, timeout: float | None = None) -> shard_pb2.HealthResponse:
        return self.stub.Health(shard_pb2.HealthRequest(), timeout=timeout or self.timeout)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the shard answers Health; raises TimeoutError after `timeout`
        seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"shard on {self.uds_path} not ready after {timeout:.0f}s")
            time.sleep(0.1)

    def warmup(
        self,
        max_batch_tokens: int,
        max_batch_size: int,
        kv_cache_bytes: int = 0,
        memory_fraction: float = 0.0,  # 0: the shard's device default
        swap_blocks: int = 0,  # 0: 4 × the blocks allocated (the router's default)
    ) -> shard_pb2.WarmupResponse:
        return self.stub.Warmup(
            shard_pb2.WarmupRequest(
                max_batch_tokens=max_batch_tokens,
                max_batch_size=max_batch_size,
                kv_cache_bytes=kv_cache_bytes,
                memory_fraction=memory_fraction,
                swap_blocks=swap_blocks,
            ),
            timeout=self.timeout,
        )

    def steps(self) -> StepStream:
        """Opens a Steps stream: a new session."""
        return StepStream(self.stub, self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

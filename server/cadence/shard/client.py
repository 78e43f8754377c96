"""A small synchronous client of one shard, for the launcher and the tests."""

from __future__ import annotations

import time

import grpc

from cadence.pb import shard_pb2, shard_pb2_grpc
from cadence.shard.server import GRPC_OPTIONS


class ShardClient:
    def __init__(self, uds_path: str, timeout: float | None = None) -> None:
        """`timeout`: deadline in seconds for every call (None: no deadline)."""
        self.uds_path = uds_path
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{uds_path}", options=GRPC_OPTIONS)
        self.stub = shard_pb2_grpc.ShardStub(self.channel)

    def info(self) -> shard_pb2.InfoResponse:
        return self.stub.Info(shard_pb2.InfoRequest(), timeout=self.timeout)

    def health(self, timeout: float | None = None) -> shard_pb2.HealthResponse:
        return self.stub.Health(shard_pb2.HealthRequest(), timeout=timeout or self.timeout)

    def wait_ready(self, timeout: float = 120.0, warmed: bool = False) -> None:
        """Blocks until the shard answers Health (and, with `warmed`, has its KV cache);
        raises TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=max(0.1, min(5.0, deadline - time.monotonic()))).ready or (
                    not warmed
                ):
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
        memory_fraction: float = 0.9,
    ) -> shard_pb2.WarmupResponse:
        return self.stub.Warmup(
            shard_pb2.WarmupRequest(
                max_batch_tokens=max_batch_tokens,
                max_batch_size=max_batch_size,
                kv_cache_bytes=kv_cache_bytes,
                memory_fraction=memory_fraction,
            ),
            timeout=self.timeout,
        )

    def step(self, req: shard_pb2.StepRequest) -> shard_pb2.StepResponse:
        return self.stub.Step(req, timeout=self.timeout)

    def clear_cache(self) -> None:
        self.stub.ClearCache(shard_pb2.ClearCacheRequest(), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

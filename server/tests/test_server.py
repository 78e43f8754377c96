"""The shard over a real unix socket: a `cadence.shard.server.serve` subprocess driven
by `ShardClient`, as the launcher and the router drive it."""

from __future__ import annotations

import itertools
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from cadence.pb import shard_pb2
from cadence.shard.client import ShardClient, StepFailed, StepStream
from shard_helpers import MiniRouter, spawn_shard


def numbered(stream: StepStream) -> Callable[[shard_pb2.StepRequest], shard_pb2.StepResponse]:
    """`stream.step` with step ids 0, 1, 2, ... as the router numbers them."""
    ids = itertools.count()

    def step(request: shard_pb2.StepRequest) -> shard_pb2.StepResponse:
        request.step_id = next(ids)
        return stream.step(request)

    return step


@pytest.fixture
def shard(model_dirs, tmp_path) -> Iterator[tuple[ShardClient, subprocess.Popen]]:  # noqa: ANN001
    uds = tmp_path / "shard-0.sock"
    uds.write_text("stale")  # left behind by a crashed process: must be replaced
    proc = spawn_shard(model_dirs("llama_gqa"), uds)
    client = ShardClient(str(uds), timeout=60)
    try:
        client.wait_ready(timeout=60)
        yield client, proc
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shard_serves_info_warmup_steps_errors_and_stops_cleanly(shard, tmp_path):
    client, proc = shard
    info = client.info()
    assert (info.model_type, info.dtype, info.device) == ("llama", "float32", "cpu")
    assert (info.block_size, info.vocab_size, list(info.eos_token_ids)) == (16, 256, [2])
    assert not client.health().ready

    with client.steps() as stream, pytest.raises(StepFailed, match="before Warmup"):
        stream.step(shard_pb2.StepRequest())

    warm = client.warmup(max_batch_tokens=256, max_batch_size=8, kv_cache_bytes=16 << 20)
    assert warm.num_blocks == (16 << 20) // warm.bytes_per_block
    assert warm.kv_cache_bytes == warm.num_blocks * warm.bytes_per_block
    assert warm.weight_bytes > 0 and client.health().ready

    stream = client.steps()
    router = MiniRouter(num_blocks=warm.num_blocks, step_fn=numbered(stream))
    resp = router.step(joined=[router.join(1, [5, 6, 7, 8]), router.join(2, [9] * 20, 7)])
    assert [g.id for g in resp.generations] == [1] and resp.computed_tokens == 11
    resp = router.step(joined=[router.join(3, [4, 4])], continuing=[router.cont(1), router.cont(2)])
    assert sorted(g.id for g in resp.generations) == [1, 2, 3]
    resp = router.step(removed=[router.remove(1)], continuing=[router.cont(2), router.cont(3)])
    assert sorted(g.id for g in resp.generations) == [2, 3]

    # a bad block id is the step's error answer; the shard serves the next step
    bad = shard_pb2.NewRequest(
        id=9, token_ids=[1, 2], prompt_len=2, num_compute=2, block_table=[warm.num_blocks + 5]
    )
    with pytest.raises(StepFailed, match=f"rejected: .*block {warm.num_blocks + 5}"):
        router.step(joined=[bad])
    resp = router.step(continuing=[router.cont(2), router.cont(3)])
    assert sorted(g.id for g in resp.generations) == [2, 3]

    # Health answers while a long Step runs
    big = [router.join(100 + i, [(7 * i + j) % 250 + 3 for j in range(700)]) for i in range(12)]
    done: dict[str, float] = {}

    def run_big() -> None:
        start = time.monotonic()
        router.step(joined=big)
        done["step"] = time.monotonic() - start

    thread = threading.Thread(target=run_big)
    thread.start()
    latencies = []  # polled from the start: the step may take only ~50 ms on this model
    while thread.is_alive():
        start = time.monotonic()
        client.health(timeout=5)
        if thread.is_alive():
            latencies.append(time.monotonic() - start)
        time.sleep(0.002)
    thread.join()
    assert latencies, f"the big step took only {done['step']:.3f}s"
    assert max(latencies) < done["step"]

    stream.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert not (tmp_path / "shard-0.sock").exists()

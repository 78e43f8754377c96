"""What the Steps stream guarantees, on a real shard over its unix socket: steps sent
ahead are answered in order, each naming its step; a step out of order or one the engine
rejects is answered with its error while the stream goes on; a new stream is a new
session, with no request of the previous one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cadence.pb import shard_pb2
from cadence.shard.client import ShardClient, StepFailed
from shard_helpers import spawn_shard


@pytest.fixture(scope="module")
def shard(model_dirs, tmp_path_factory) -> Iterator[tuple[ShardClient, int]]:  # noqa: ANN001
    """A warmed shard and its number of KV blocks."""
    uds = tmp_path_factory.mktemp("stream") / "shard-0.sock"
    proc = spawn_shard(model_dirs("llama_gqa"), uds)
    client = ShardClient(str(uds), timeout=60)
    try:
        client.wait_ready(timeout=60)
        warm = client.warmup(max_batch_tokens=64, max_batch_size=8, kv_cache_bytes=4 << 20)
        yield client, warm.num_blocks
    finally:
        client.close()
        proc.kill()
        proc.wait()


def _join(rid: int, tokens: list[int], block: int) -> shard_pb2.NewRequest:
    """A request that fits in one block and computes its whole prompt."""
    n = len(tokens)
    return shard_pb2.NewRequest(
        id=rid, token_ids=tokens, prompt_len=n, num_compute=n, block_table=[block]
    )


def _decode(rid: int) -> shard_pb2.ContinuingRequest:
    return shard_pb2.ContinuingRequest(id=rid, num_compute=1)


def _step(step_id: int, **diff: list) -> shard_pb2.StepRequest:  # type: ignore[type-arg]
    return shard_pb2.StepRequest(step_id=step_id, **diff)


def test_steps_sent_ahead_are_answered_in_order_each_naming_its_step(shard) -> None:  # noqa: ANN001
    client, _ = shard
    with client.steps() as stream:
        stream.send(_step(40, joined=[_join(1, [5, 6, 7, 8], block=0)]))
        stream.send(_step(41, joined=[_join(2, [9, 9, 9], block=1)]))
        # decodes the tokens sampled by the two steps before, whose answers are unread
        stream.send(_step(42, continuing=[_decode(1), _decode(2)]))
        answers = [stream.answer() for _ in range(3)]
    assert [a.step_id for a in answers] == [40, 41, 42]
    assert [sorted(g.id for g in a.response.generations) for a in answers] == [[1], [2], [1, 2]]


def test_a_step_out_of_order_is_refused_and_the_stream_goes_on(shard) -> None:  # noqa: ANN001
    client, _ = shard
    with client.steps() as stream:
        stream.step(_step(7, joined=[_join(1, [5, 6, 7], block=0)]))
        computed = client.health().computed_tokens_total
        for wrong in (9, 7, 3):  # one skipped, one repeated, one gone back to
            with pytest.raises(StepFailed, match=f"step {wrong} out of order: step 8 comes next"):
                stream.step(_step(wrong, continuing=[_decode(1)]))
        assert client.health().computed_tokens_total == computed  # none of them ran
        for step_id in (8, 9):
            resp = stream.step(_step(step_id, continuing=[_decode(1)]))
            assert [g.id for g in resp.generations] == [1] and resp.computed_tokens == 1


def test_a_failed_step_is_its_own_answer_and_the_next_step_runs(shard) -> None:  # noqa: ANN001
    client, num_blocks = shard
    with client.steps() as stream:
        stream.send(_step(0, joined=[_join(9, [1, 2], block=num_blocks + 5)]))
        stream.send(_step(1, joined=[_join(1, [5, 6, 7], block=0)]))
        failed, ran = stream.answer(), stream.answer()
    assert failed.step_id == 0 and f"step 0 rejected: request 9: block {num_blocks + 5}" in (
        failed.error
    )
    assert ran.step_id == 1 and [g.id for g in ran.response.generations] == [1]


def test_a_new_stream_is_a_new_session_without_the_old_requests(shard) -> None:  # noqa: ANN001
    client, _ = shard
    with client.steps() as old:
        old.step(_step(100, joined=[_join(1, [5, 6, 7], block=0)]))
        with client.steps() as new:
            # any first id opens a session; request 1 belonged to the old one
            with pytest.raises(StepFailed, match="step 3 rejected: continuing request 1 is not"):
                new.step(_step(3, continuing=[_decode(1)]))
            resp = new.step(_step(4, joined=[_join(2, [4, 4], block=1)]))
            assert [g.id for g in resp.generations] == [2]
        with pytest.raises(StepFailed, match="a newer Steps stream replaced this one"):
            old.step(_step(101, joined=[_join(3, [4, 4], block=2)]))

"""LoadAdapter / DropAdapter over the shard's real socket: a refusal (no folder, a folder
without an adapter) is INVALID_ARGUMENT with a message saying why, and the shard goes on
serving."""

from __future__ import annotations

import grpc
import pytest
from cadence.pb import shard_pb2
from cadence.shard.client import ShardClient
from shard_helpers import spawn_shard


def test_load_adapter_refusals_are_invalid_argument(model_dirs, tmp_path):
    uds = tmp_path / "shard.sock"
    proc = spawn_shard(model_dirs("llama_gqa"), uds)
    client = ShardClient(str(uds), timeout=60)
    try:
        client.wait_ready(timeout=60)
        missing = tmp_path / "no-such-adapter"
        request = shard_pb2.LoadAdapterRequest(name="a", path=str(missing))
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.LoadAdapter(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(missing) in refused.value.details()
        empty = tmp_path / "empty"  # a folder, but no PEFT adapter in it
        empty.mkdir()
        request = shard_pb2.LoadAdapterRequest(name="b", path=str(empty))
        with pytest.raises(grpc.RpcError) as refused:
            client.stub.LoadAdapter(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter_config.json" in refused.value.details()
        client.stub.DropAdapter(shard_pb2.DropAdapterRequest(name="a"), timeout=60)
        assert client.info().model_type == "llama"  # still serving
    finally:
        client.close()
        proc.kill()
        proc.wait()

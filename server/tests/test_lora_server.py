"""LoadAdapter / DropAdapter over the shard's real socket: a refusal is INVALID_ARGUMENT
with a message naming the path, and the shard goes on serving."""

from __future__ import annotations

import grpc
import pytest
from cadence.pb import shard_pb2
from cadence.shard.client import ShardClient
from shard_helpers import spawn_shard


def test_load_adapter_refusal_is_invalid_argument_naming_the_path(model_dirs, tmp_path):
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
        client.stub.DropAdapter(shard_pb2.DropAdapterRequest(name="a"), timeout=60)
        assert client.info().model_type == "llama"  # still serving
    finally:
        client.close()
        proc.kill()
        proc.wait()

"""The shard process: per-request state, the model runner and the gRPC servicer."""

"""Shards: the engine protocol, the shard worker process, the router, the vLLM engine."""

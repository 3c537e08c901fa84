"""Shards: engine protocol, vLLM adapter, worker process, router."""

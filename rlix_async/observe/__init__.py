"""Observability: the status table, the timeline chart, Prometheus metrics.

Everything here reads what the control plane publishes (a ``StatusReply``, a
journal) and never reaches into the coordinator's state.
"""

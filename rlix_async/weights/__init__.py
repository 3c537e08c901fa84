"""Weights: bucket packing, versioned host cache, streaming to shards."""

"""kvroute's metrics data plane: frames → KvMetrics → per-worker actor → singleton aggregator."""

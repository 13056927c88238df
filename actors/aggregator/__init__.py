"""The singleton aggregator (`actor`) and its soft state (`registry`): the fleet's single source of
truth, filled by the worker actors' pushes and published to router replicas as deltas."""

"""The worker actor (`actor`: one Ray actor per SGLang worker) and what it is made of: the bound
metrics PULL (`endpoint`), frames → latest metrics (`ingest`), coalesced pushes (`metrics_pipe`,
`push_window`), liveness (`health`), the KV-event subscription and log (`kv_subscriber`, `kv_log`),
and the managed engine process (`launcher`)."""

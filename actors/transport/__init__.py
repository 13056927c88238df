"""kvroute's own ZeroMQ plumbing between its processes: the PUSH link to the aggregator
(`link`), receive-side wake-ups (`readable`) and reconnect back-off (`retry`)."""

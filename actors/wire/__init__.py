"""What SGLang sends kvroute, decoded without executing anything: KvMetrics frames (public:
`decode_kv_metrics`, `WireError`), KV-event batches (`actors.wire.kv_events`) and who binds the
KV-event socket in each release (`actors.wire.kv_handshake`). Pure: no Ray, no sockets."""

from actors.wire.kv_metrics import KV_METRICS_MODULES, WireError, decode_kv_metrics

__all__ = ["KV_METRICS_MODULES", "WireError", "decode_kv_metrics"]

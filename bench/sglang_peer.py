"""sglang-router as a benchmark peer: the policies run, the flags each runs with, how it is started."""

from __future__ import annotations

import sys

SGLANG_POLICIES = ("round_robin", "cache_aware", "power_of_two")
# The flags every sglang-router target runs with, besides addresses: the policy and the defaults
# its docs recommend (named so the report can say exactly what ran), quiet logs. Same for the
# nodelay variants. power_of_two polls the workers' `GET /get_load` every
# `--worker-startup-check-interval` seconds (its LoadMonitor's interval), which SGLang 0.5.23 no longer has.
SGLANG_ROUTER_FLAGS: dict[str, tuple[str, ...]] = {
    "round_robin": ("--policy", "round_robin"),
    "cache_aware": ("--policy", "cache_aware", "--cache-threshold", "0.3", "--balance-abs-threshold", "64",
                    "--balance-rel-threshold", "1.5", "--eviction-interval-secs", "60",
                    "--max-tree-size", str(2**26)),
    "power_of_two": ("--policy", "power_of_two", "--worker-startup-check-interval", "30"),
}
SGLANG_COMMON_FLAGS = ("--log-level", "warn")
NODELAY_SUFFIX = "-nodelay"
# nodelay variants started when every target is (no --targets list); the others only when named
NODELAY_BY_DEFAULT = ("cache_aware",)
SGLANG_STALL_NOTE = (
    "sglang-router {version} never sets TCP_NODELAY on the client connections it accepts (axum_server's "
    "default): on a keep-alive connection reused within ~40 ms, a streamed reply's first body bytes wait for "
    "the client's delayed ACK (~40 ms on Linux) — a TCP floor on TTFT at low concurrency, not routing cost. "
    "See the `-nodelay` row for its routing cost without the stall"
)
SGLANG_NODELAY_NOTE = (
    "The same sglang-router {version} binary and flags with TCP_NODELAY forced on every accepted socket "
    "(LD_PRELOAD shim wrapping accept/accept4, bench/nodelay/nodelay.c, built at run time): what users get "
    "once the peer sets TCP_NODELAY"
)

SGLANG_PER_MODEL_NOTE = (
    "Multi-model fleet: one sglang-router process per model over that model's workers, the load generator "
    "sending each request to its model's router (their CPU is summed). sglang-router's own multi-model "
    "gateway mode (`--enable-igw`) panics at start on a machine without internet access: it downloads the "
    "o200k_base vocabulary for its harmony parser (openaipublic.blob.core.windows.net) before serving"
)


def sglang_router_argv(policy: str, port: int, urls: tuple[str, ...], prometheus_port: int) -> list[str]:
    """How a sglang-router target is started (the nodelay variant adds only LD_PRELOAD)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
            *SGLANG_ROUTER_FLAGS[policy], "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port), *SGLANG_COMMON_FLAGS]


def _sglang_router_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-router")
    except PackageNotFoundError:
        return "?"


# PD mode (`--pd-disaggregation`, docs/pd.md): a policy per side. "cache_aware" is the pairing
# sglang-router's PD design names (cache-aware prefill tree, power-of-two decode; issue
# sgl-project/sglang#7031), with the cache_aware defaults above; "round_robin" the control.
SGLANG_PD_FLAGS: dict[str, tuple[str, ...]] = {
    "cache_aware": ("--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
                    *SGLANG_ROUTER_FLAGS["cache_aware"][2:], "--worker-startup-check-interval", "30"),
    "round_robin": ("--prefill-policy", "round_robin", "--decode-policy", "round_robin"),
}


def sglang_router_pd_argv(policy: str, port: int, prefill: list[tuple[str, int]], decode: list[str],
                          prometheus_port: int) -> list[str]:
    """sglang-router in PD mode: `--prefill URL BOOTSTRAP_PORT` per prefill server, `--decode URL` per decode one."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bport in prefill:
        argv += ["--prefill", url, str(bport)]
    for url in decode:
        argv += ["--decode", url]
    return argv + [*SGLANG_PD_FLAGS[policy], "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port), *SGLANG_COMMON_FLAGS]

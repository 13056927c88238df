"""Run `python -m sglang.launch_server` with the scheduler's metrics address fixed from outside.

SGLang picks its KvMetrics ipc:// path at random inside the server process (`PortArgs.init_new`)
and never prints it, so the worker actor — which must BIND that address — cannot learn it. This
wrapper (run in the child process only; kvroute itself never imports sglang) replaces the random
`metrics_ipc_name` with `$KVROUTE_METRICS_IPC_NAME` before any scheduler starts.
Usage: KVROUTE_METRICS_IPC_NAME=ipc:///tmp/w1.metrics python -m actors.sglang_launch <sglang args>
"""

from __future__ import annotations

import os
import runpy
import sys

ENV = "KVROUTE_METRICS_IPC_NAME"


def _patch_port_args(endpoint: str) -> None:
    from sglang.srt import server_args  # imported only in the SGLang child process

    original = server_args.PortArgs.init_new

    def init_new(*args, **kwargs):
        port_args = original(*args, **kwargs)
        # DP-attention uses one shared tcp:// address for all ranks: leave it alone
        if str(port_args.metrics_ipc_name).startswith("ipc://"):
            port_args.metrics_ipc_name = endpoint
        return port_args

    server_args.PortArgs.init_new = staticmethod(init_new)


def main() -> None:
    endpoint = os.environ.get(ENV)
    if not endpoint:
        sys.exit(f"{ENV} is not set: the worker actor must choose the metrics endpoint")
    _patch_port_args(endpoint)
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""An experiment, not kvroute code: kv_aware's stall pricing (the pause a prompt's prefill causes the
requests decoding on the worker) by prompt size — P_S below P_THR prompt blocks, P_SBIG at or above
— added by patching KvAware._fleet_cost, then bench.routesim's CLI (bench/results/dynamo.md):

    P_SBIG=0.5 P_THR=256 python bench/results/dynamo-size-stall.py --suite standard --workload mooncake \\
        --rates 20 --seeds 10 --policies kv_aware
"""
import os, sys
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from serve_app.policies import kv_aware as K

S = float(os.environ.get("P_S", "0"))        # stall weight for prompts below the threshold
THR = float(os.environ.get("P_THR", "64"))   # prompt blocks
SBIG = float(os.environ.get("P_SBIG", "0"))  # stall weight at or above it

_fc = K.KvAware._fleet_cost
def fleet_cost(self, request, fleet):
    cost, o = _fc(self, request, fleet)
    P = request.prompt_blocks
    s = S if P < THR else SBIG
    if not s:
        return cost, o
    new = P if o is None else P - o
    dec = np.array([max(w.in_flight - w.prefilling, w.running) for w in fleet], float)
    return cost + s * self.config.prefill_weight * new * dec, o
K.KvAware._fleet_cost = fleet_cost

from bench import routesim
sys.exit(routesim.main())

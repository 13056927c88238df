"""An experiment, not kvroute code: two max_tokens-aware terms added to kv_aware's cost by patching
KvAware._fleet_cost, then bench.routesim's CLI (bench/results/dynamo.md, "The reply's length").

    P_A=2 P_B=4 python bench/results/dynamo-max-tokens.py --suite standard --workload mooncake \\
        --rates 20 --seeds 10 --policies kv_aware

P_A: prefills avoid workers with output still to come; P_B: a reply avoids workers with a high
recent prefill rate (P_T its window, s; P_STEP the decode step assumed, s)."""
import os, sys
from collections import deque
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from serve_app import router as R, ledger as L
from serve_app.policies import kv_aware as K

A = float(os.environ.get("P_A", "0"))      # push: prefill blocks avoid workers with much decode still to come
B = float(os.environ.get("P_B", "0"))      # pull: a long reply prefers a worker with a low recent prefill rate
T = float(os.environ.get("P_T", "4"))      # window of the prefill rate, s
STEP = float(os.environ.get("P_STEP", "0.0096"))
ST = {}    # rid -> [worker, max_tokens, t_first or None]
RATE = {}  # worker -> deque[(t, blocks)]
CLOCK = [None]

_on_routed = R.RouterCore.on_routed
def on_routed(self, rid, request, worker, *a, **k):
    cached = _on_routed(self, rid, request, worker, *a, **k)
    CLOCK[0] = self.ledger._clock
    now = CLOCK[0]()
    ST[rid] = [worker, request.max_tokens, None]
    RATE.setdefault(worker, deque()).append((now, request.prompt_blocks - cached))
    return cached
R.RouterCore.on_routed = on_routed

_oft = L.Ledger.on_first_token
def oft(self, rid):
    s = ST.get(rid)
    if s is not None and s[2] is None:
        s[2] = self._clock()
    return _oft(self, rid)
L.Ledger.on_first_token = oft
for m in ("on_finished", "on_failed"):
    orig = getattr(L.Ledger, m)
    def end(self, rid, orig=orig):
        ST.pop(rid, None)
        return orig(self, rid)
    setattr(L.Ledger, m, end)

_fc = K.KvAware._fleet_cost
def fleet_cost(self, request, fleet):
    cost, o = _fc(self, request, fleet)
    if CLOCK[0] is None or not (A or B):
        return cost, o
    now = CLOCK[0]()
    names = list(fleet.names)
    rem = dict.fromkeys(names, 0.0)
    for w, mt, tf in ST.values():
        if tf is not None and w in rem:
            rem[w] += max(0.0, mt - (now - tf) / STEP)
    P = request.prompt_blocks
    new = P if o is None else P - o
    extra = np.zeros(len(names))
    pw = self.config.prefill_weight
    for i, n in enumerate(names):
        q = RATE.get(n, ())
        while q and q[0][0] < now - T:
            q.popleft()
        rate = sum(b for _, b in q) / T  # prefill blocks/s routed there lately
        # A: each new block pauses the decoders there; priced per 100 output tokens still to come
        # B: this reply pauses for the prefills that will land there while it decodes
        extra[i] = A * pw * rem[n] / 100.0 * (new[i] if hasattr(new, "__len__") else new) / max(P, 1) \
            + B * pw * rate * request.max_tokens * STEP
    return cost + extra, o
K.KvAware._fleet_cost = fleet_cost

from bench import routesim
sys.exit(routesim.main())

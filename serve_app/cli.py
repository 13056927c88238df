"""`kvroute` command line: demo (embedded default), serve (attach to / launch a fleet), status."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from actors.fleet import FleetError, FleetSpec, parse_fleet
from actors.models import NAMESPACE
from serve_app.config import ADMIN_KEY_ENV, API_KEY_ENV, APP_NAME, CLI_FLAGS, RouterConfig, load_config, parse_config
from serve_app.ray_env import apply_serve_env

log = logging.getLogger("kvroute.cli")

DEFAULT_PORT = 8000


class Stop(Exception):
    pass


def _explain(exc: BaseException) -> str:
    """The user-facing line out of a Ray error (e.g. an actor whose __init__ raised)."""
    text = str(exc)
    for marker in ("EndpointError: ", "FleetError: ", "LaunchError: ", "ValueError: "):
        if marker in text:
            return text.rsplit(marker, 1)[1].strip().splitlines()[0]
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__


class FleetRunner:
    """Starts Ray (or joins one), the aggregator, one actor per worker and the router app; tears
    all of it down again — worker actors, the detached aggregator, the Serve app."""

    def __init__(self, fleet: FleetSpec, router: RouterConfig, *, host: str, port: int, address: str | None,
                 progress=print, verbose: bool = False) -> None:
        self.verbose = verbose
        self.fleet = fleet
        self.router = router
        self.host = host
        self.port = port
        self.address = address
        self.progress = progress
        self.actors: dict[str, Any] = {}
        self._started_ray = False

    def start(self) -> str:
        import ray
        from ray import serve

        from actors.admin import READY_SLACK_S
        from actors.aggregator.actor import get_or_create_aggregator
        from actors.worker.actor import start_worker
        from serve_app.app import build_app

        secrets_via_env = not self.address
        if not self.address:
            # Ray's token auth stays on (2.60 default; ray.init makes a token in ~/.ray): a local
            # Ray still listens on every interface, and an open GCS runs anyone's code.
            # keys reach the replicas through the environment the local Ray inherits, not through
            # the Serve app config (which `serve status` and the dashboard show)
            for env, key in ((API_KEY_ENV, self.router.api_key), (ADMIN_KEY_ENV, self.router.admin_key)):
                if key:
                    os.environ[env] = key
        if not ray.is_initialized():
            if not self.address:
                apply_serve_env()  # a cluster's nodes carry it themselves (cluster.yaml, KubeRay env)
            self.progress(f"starting Ray ({'joining ' + self.address if self.address else 'local'}) …")
            # no --address: a Ray of our own, never one that `ray start` or another program left running
            ray.init(address=self.address or "local", namespace=NAMESPACE, include_dashboard=False,
                     logging_level=logging.WARNING, log_to_driver=self.verbose)
            logging.getLogger("ray.serve").setLevel(logging.INFO if self.verbose else logging.WARNING)
            self._started_ray = True
        settings = self.fleet.settings
        agg = get_or_create_aggregator(settings)
        ray.get(agg.ping.remote(), timeout=60)
        workers = self.fleet.expanded()
        self.progress(f"starting {len(workers)} worker actor(s) …")
        for spec in workers:
            try:
                self.actors[spec.name] = start_worker(spec, settings)
            except Exception as exc:  # a bad endpoint, resources no node has
                raise FleetError(_explain(exc)) from None
        for name, actor in self.actors.items():
            try:
                info = ray.get(actor.ready.remote(), timeout=settings.engine_start_timeout_s + READY_SLACK_S)
            except Exception as exc:
                raise FleetError(_explain(exc)) from None
            self.progress(f"  worker {name}: metrics on {info.metrics_endpoint}, http {info.url}")
        self.progress("starting the router (Ray Serve) …")
        serve.start(http_options={"host": self.host, "port": self.port})
        # this process owns the worker actors (they die with it); replicas need not create them
        router = self.router.model_dump(mode="json")
        if secrets_via_env:
            router.pop("api_key"), router.pop("admin_key")
        # the router goes in args.router (its one place in the app's args), never inside the fleet
        fleet = self.fleet.model_dump(mode="json", exclude={"router"})
        args = {"fleet": fleet, "router": router, "manage_fleet": False}
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    def stop(self) -> None:
        import ray
        from ray import serve

        from actors.aggregator.actor import kill_aggregator
        from actors.worker.actor import stop_workers

        if not ray.is_initialized():
            return
        self.progress("stopping worker actors …")
        refs = [a.stop.remote(deregister=False) for a in self.actors.values()]
        try:
            ray.get(refs, timeout=15)
        except Exception as exc:
            log.warning("some worker actors did not stop cleanly: %s", exc)
        for a in self.actors.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        stop_workers()  # and any worker added at run time (fleet add: detached actors)
        self.progress("stopping the router …")
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        except Exception as exc:
            log.warning("serve shutdown: %s", exc)
        kill_aggregator()
        if self._started_ray:
            ray.shutdown()


def _wait_for_interrupt(tick=None, period_s: float = 1.0) -> None:
    stop = threading.Event()

    def handler(signum, frame):  # noqa: ARG001
        stop.set()

    old_int = signal.signal(signal.SIGINT, handler)
    old_term = signal.signal(signal.SIGTERM, handler)
    try:
        while not stop.is_set():
            if tick is not None:
                tick()
            stop.wait(period_s)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _router_config(ns: argparse.Namespace, base: RouterConfig | None = None) -> RouterConfig:
    """The router of `base` (the fleet file's `router:`) with each flag given on the command line
    (`CLI_FLAGS`) overriding its key, then the keys from the environment."""
    cfg: dict[str, Any] = base.model_dump() if base is not None else {}
    for flag, key in CLI_FLAGS.items():
        value = getattr(ns, _flag_dest(flag), None)
        if value is not None:
            cfg[key] = value
    return RouterConfig.model_validate(cfg).with_env()


def _run(fleet: FleetSpec, ns: argparse.Namespace, *, live_table: bool) -> int:
    try:
        router = _router_config(ns, getattr(fleet, "router", None))
    except Exception as exc:
        print(f"kvroute: invalid router option: {exc}", file=sys.stderr)
        return 2
    runner = FleetRunner(fleet, router, host=ns.host, port=ns.port, address=getattr(ns, "address", None),
                         verbose=ns.verbose)
    try:
        url = runner.start()
    except (FleetError, ValueError) as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        runner.stop()
        return 2
    except KeyboardInterrupt:
        runner.stop()
        return 130
    _print_banner(url, router, sorted({m for w in fleet.expanded() for m in w.declared_models}))
    table = None
    if live_table:
        from serve_app.status import LiveTable

        table = LiveTable(url, api_key=router.api_key)
    try:
        _wait_for_interrupt(table.tick if table else None, period_s=1.0)
    finally:
        if table is not None:
            table.close()
        t0 = time.monotonic()
        runner.stop()
        print(f"kvroute: stopped in {time.monotonic() - t0:.1f} s")
    return 0


def _print_banner(url: str, router: RouterConfig, models: list[str] | None = None) -> None:
    """The startup banner: a request that works on the fleet at hand — a model it declares (any name
    would do on a single-model fleet, as with SGLang, unless strict_models), or, when the workers'
    names are discovered at run time, none in curl (a single-model fleet needs none) and the first
    one the router lists in the SDK snippet."""
    auth = ' -H "Authorization: Bearer $KVROUTE_API_KEY"' if router.api_key else ""
    print(f"\nkvroute is listening on {url}  (policy {router.policy}; Ctrl-C to stop)\n")
    if models:
        print(f"  models: {', '.join(models)}")
    print("  curl:")
    print(f"    curl -s {url}/v1/chat/completions{auth} -H 'content-type: application/json' \\")
    body: dict = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
    if models:
        body = {"model": models[0], **body}
    print(f"      -d '{json.dumps(body)}'")
    print("  openai SDK:")
    print("    from openai import OpenAI")
    key = "os.environ['KVROUTE_API_KEY']" if router.api_key else "'unused'"
    print(f"    client = OpenAI(base_url='{url}/v1', api_key={key})")
    model = repr(models[0]) if models else "client.models.list().data[0].id"
    print(f"    client.chat.completions.create(model={model}, messages=[{{'role': 'user', 'content': 'Hello'}}])")
    print(f"  workers: {url}/workers   health: {url}/healthz   status: kvroute status --url {url}\n", flush=True)


def demo_fleet(n: int, *, tmpdir: str, base_port: int | None = None, wire: str = "0.5.23",
               time_scale: float = 1.0, models: list[str] | None = None, dp_size: int = 1) -> FleetSpec:
    """N simulated SGLang workers, each launched by its actor, metrics on ipc:// in `tmpdir`;
    with `models`, worker i serves models[i % len(models)]; each with `dp_size` attention-DP ranks."""
    workers = []
    for i in range(n):
        w: dict[str, Any] = {
            "name": f"sim-{i}",
            "engine": "sim",
            "page_size": 16,
            "metrics_endpoint": f"ipc://{tmpdir}/sim-{i}.metrics",
            "engine_args": {"wire": wire, "time_scale": time_scale},
        }
        if base_port:
            w["url"] = f"http://127.0.0.1:{base_port + i}"
        if models:
            w["model"] = models[i % len(models)]
        if dp_size > 1:
            w["dp_size"] = dp_size
        workers.append(w)
    return parse_fleet({"workers": workers}, "demo")


SGLANG_DEMO_RELEASE = "0.5.23"  # the release scripts/sglang_env.sh builds the real-engine venv of
_REPO = Path(__file__).resolve().parents[1]
# SGLang's server on a machine without a GPU: its CPU engine, the flags known to work there
# (docs/real-engine.md) and, for the two sgl_kernel functions the CPU path imports, the plain-torch
# stand-in the real-engine lane uses (tests/real_engine/cpu_kernels: not for production)
_CPU_ENGINE_ARGS = {"device": "cpu", "dtype": "float32", "attention_backend": "torch_native",
                    "disable_overlap_schedule": True, "max_total_tokens": 8192, "max_running_requests": 8,
                    "mem_fraction_static": 0.05}


def sglang_python(given: str | None = None) -> Path:
    """The Python of SGLang's environment for `demo --engine sglang`: `given`, else the venv that
    `scripts/sglang_env.sh 0.5.23` builds (under $SGLANG_ENV_DIR, the checkout's .venv-sglang, or
    ~/.cache/kvroute/venv-sglang). FleetError naming the places looked at if there is none."""
    if given:
        p = Path(given)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise FleetError(f"--sglang-python {given}: not an executable file")
        return p
    roots = [os.environ.get("SGLANG_ENV_DIR"), str(_REPO / ".venv-sglang"),
             str(Path.home() / ".cache" / "kvroute" / "venv-sglang")]
    tried = []
    for root in filter(None, roots):
        p = Path(root) / SGLANG_DEMO_RELEASE / "bin" / "python"
        tried.append(str(p))
        if p.is_file() and (p.parents[1] / ".kvroute-ready").is_file():
            return p
    raise FleetError("demo --engine sglang needs SGLang's environment: build it with `scripts/sglang_env.sh "
                     f"{SGLANG_DEMO_RELEASE}` (~4 GB, a few minutes) or name one with --sglang-python; looked for "
                     + ", ".join(tried))


def tiny_model(python: Path, directory: Path) -> Path:
    """The real-engine lane's tiny random Llama (tests/real_engine/tiny_model.py: deterministic, no
    network), made once in `directory` with SGLang's Python (it needs torch and transformers)."""
    r = subprocess.run([str(python), "-c", "import sys; from tests.real_engine.tiny_model import ensure; "
                        "print(ensure(sys.argv[1]))", str(directory)], cwd=_REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise FleetError(f"could not make the tiny model in {directory}: {r.stderr.strip()[-500:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def sglang_demo_fleet(n: int, *, tmpdir: str, python: Path, model: Path, cpu: bool) -> FleetSpec:
    """N real SGLang servers, each launched by its worker actor in SGLang's own Python; exact prefix
    mode (KV events, the model's own tokenizer). `cpu`: SGLang's CPU engine (no GPU here)."""
    env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(_REPO / "tests" / "real_engine" / "cpu_kernels")} if cpu else {}
    workers = [{
        "name": f"sglang-{i}", "engine": "sglang", "model": str(model), "python": str(python), "env": env,
        "page_size": 16, "metrics_endpoint": f"ipc://{tmpdir}/sglang-{i}.metrics", "kv_events_endpoint": "auto",
        "engine_args": {**(_CPU_ENGINE_ARGS if cpu else {}), "sleep_on_idle": True},
    } for i in range(n)]
    return parse_config({"workers": workers, "router": {"tokenizer": f"hf:{model}", "block_size": 16}}, "demo")


def _demo_sglang(ns: argparse.Namespace, tmp: str) -> FleetSpec:
    import shutil

    python = sglang_python(ns.sglang_python)
    model = Path(ns.model) if ns.model else tiny_model(python, Path.home() / ".cache" / "kvroute" / "tiny-model")
    cpu = shutil.which("nvidia-smi") is None
    print(f"kvroute demo: {ns.workers} real SGLang {SGLANG_DEMO_RELEASE} server(s) of {model} in {python}"
          + (" (CPU engine: no GPU here)" if cpu else ""), flush=True)
    return sglang_demo_fleet(ns.workers, tmpdir=tmp, python=python, model=model, cpu=cpu)


def cmd_demo(ns: argparse.Namespace) -> int:
    if ns.workers < 1:
        print("kvroute: --workers must be at least 1", file=sys.stderr)
        return 2
    models = [m.strip() for m in ns.models.split(",")] if ns.models else None
    if models is not None and (not all(models) or len(set(models)) != len(models)):
        print("kvroute: --models must be distinct comma-separated names, e.g. --models A,B", file=sys.stderr)
        return 2
    if models is not None and ns.workers < len(models):
        print(f"kvroute: --models names {len(models)} models: --workers must be at least {len(models)}",
              file=sys.stderr)
        return 2
    if not 1 <= ns.dp_size <= 64:
        print("kvroute: --dp-size must be 1..64", file=sys.stderr)
        return 2
    if ns.engine == "sglang" and (models or ns.dp_size > 1):
        print("kvroute: --models and --dp-size are for the simulated workers (--engine sim)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-") as tmp:
        try:
            fleet = _demo_sglang(ns, tmp) if ns.engine == "sglang" else demo_fleet(
                ns.workers, tmpdir=tmp, wire=ns.wire, time_scale=ns.time_scale, models=models, dp_size=ns.dp_size)
        except FleetError as exc:
            print(f"kvroute: {exc}", file=sys.stderr)
            return 2
        return _run(fleet, ns, live_table=not ns.no_table)


def cmd_serve(ns: argparse.Namespace) -> int:
    try:
        fleet = load_config(ns.fleet)
    except FleetError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 2
    return _run(fleet, ns, live_table=False)


def cmd_status(ns: argparse.Namespace) -> int:
    from serve_app.status import print_status

    return print_status(ns.url, api_key=ns.api_key or os.environ.get("KVROUTE_API_KEY"))


def _admin_call(ns: argparse.Namespace, method: str, path: str, body: Any = None) -> int:
    import httpx

    key = ns.admin_key or os.environ.get("KVROUTE_ADMIN_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, f"{ns.url.rstrip('/')}{path}", json=body, headers=headers, timeout=330)
    except httpx.HTTPError as exc:
        print(f"kvroute: cannot reach {ns.url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text[:300]
        print(f"kvroute: {r.status_code}: {msg}", file=sys.stderr)
        return 1
    print(r.text)
    return 0


def cmd_fleet_add(ns: argparse.Namespace) -> int:
    try:
        fleet = load_config(ns.file)  # a whole config file too: only its workers are sent
    except FleetError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 2
    return _admin_call(ns, "POST", "/admin/workers", {"workers": [w.model_dump(mode="json") for w in fleet.workers]})


def cmd_fleet_remove(ns: argparse.Namespace) -> int:
    return _admin_call(ns, "DELETE", f"/admin/workers/{ns.name}")


def cmd_down(ns: argparse.Namespace) -> int:
    """Remove everything kvroute left on a cluster (serve deploy path): app, workers, aggregator."""
    import ray
    from ray import serve

    from actors.aggregator.actor import kill_aggregator
    from actors.worker.actor import stop_workers

    ray.init(address=ns.address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    try:
        serve.delete(APP_NAME)
    except Exception as exc:
        log.info("serve delete: %s", exc)
    workers = stop_workers()
    agg = kill_aggregator()
    print(f"kvroute down: removed app {APP_NAME!r}, {len(workers)} worker actor(s), "
          f"aggregator {'killed' if agg else 'not found'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for SGLang workers on Ray")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", default="127.0.0.1", help="router HTTP host (default 127.0.0.1)")
        sp.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"router HTTP port (default {DEFAULT_PORT})")
        for flag, key in CLI_FLAGS.items():  # router keys: type, help and default from RouterConfig
            field = RouterConfig.model_fields[key]
            kind = next((t for t in (int, float) if field.annotation is t), str)
            sp.add_argument(flag, type=kind, default=None, dest=_flag_dest(flag),
                            help=f"router.{key}: {field.description} (default {field.default})".replace("%", "%%"))
        sp.add_argument("-v", "--verbose", action="store_true")

    d = sub.add_parser("demo", help="local Ray + N simulated SGLang workers + the router")
    d.add_argument("--workers", type=int, default=3)
    d.add_argument("--wire", default="0.5.23", help="KvMetrics wire form the simulated workers send")
    d.add_argument("--models", default=None, help="comma-separated model names: a multi-model fleet, workers split "
                   "between them (e.g. --models A,B)")
    d.add_argument("--time-scale", type=float, default=1.0, help="simulated engine time scale (<1 = faster)")
    d.add_argument("--dp-size", type=int, default=1, help="attention-DP ranks per simulated worker: the router "
                   "picks worker and rank (default 1)")
    d.add_argument("--no-table", action="store_true", help="do not draw the live worker table")
    d.add_argument("--engine", choices=["sim", "sglang"], default="sim", help="sim: simulated workers (default); "
                   "sglang: SGLang's real server, in the environment scripts/sglang_env.sh builds (on a machine "
                   "without a GPU, its CPU engine serving a tiny model made on the spot)")
    d.add_argument("--model", default=None, help="with --engine sglang: the model directory (default: the tiny "
                   "random Llama of the real-engine lane, made once in ~/.cache/kvroute/tiny-model)")
    d.add_argument("--sglang-python", default=None, help="with --engine sglang: the Python of SGLang's environment "
                   "(default: the venv of scripts/sglang_env.sh 0.5.23)")
    common(d)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("serve", help="attach to (or launch) the workers of a fleet file")
    s.add_argument("--fleet", required=True, help="fleet YAML file")
    s.add_argument("--address", default=None, help="Ray address to join (default: start a local Ray)")
    common(s)
    s.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="print the worker table once")
    st.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}")
    st.add_argument("--api-key", default=None)
    st.set_defaults(func=cmd_status)

    fl = sub.add_parser("fleet", help="add or remove workers of a running router (admin key)")
    fsub = fl.add_subparsers(dest="fleet_cmd", required=True)
    fa = fsub.add_parser("add", help="add the workers of a fleet file")
    fa.add_argument("file")
    fr = fsub.add_parser("remove", help="remove one worker by name")
    fr.add_argument("name")
    for sp in (fa, fr):
        sp.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}")
        sp.add_argument("--admin-key", default=None, help="env KVROUTE_ADMIN_KEY")
    fa.set_defaults(func=cmd_fleet_add)
    fr.set_defaults(func=cmd_fleet_remove)

    dn = sub.add_parser("down", help="remove kvroute's app, worker actors and aggregator from a cluster")
    dn.add_argument("--address", default="auto")
    dn.set_defaults(func=cmd_down)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(ns, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())

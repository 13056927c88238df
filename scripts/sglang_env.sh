#!/usr/bin/env bash
# Build (once, cached) the venv of the SGLang contract lane: `pytest -m sglang` runs kvroute against
# SGLang's own Python code on a CPU-only machine.
#
#   scripts/sglang_env.sh [RELEASE]      # default 0.5.23; prints the venv's path on its last line
#   SGLANG_ENV_DIR=…  picks where the venvs live (default: <repo>/.venv-sglang/<release>)
#
# What goes in: torch 2.13.0 (the CPU wheel on this machine's disk — never an unpinned `torch`, which
# pulls a multi-GB CUDA build), sglang==RELEASE with --no-deps, exactly the packages its import of
# `sglang.srt.server_args`, `…disaggregation.kv_events` and the KvMetrics publisher needs, and
# kvroute itself (`-e .[test]`). Every install runs under a constraint pinning torch, so no
# dependency can swap it. One exception is not the real package: PyPI's torchvision wheels are
# CUDA builds whose C ops cannot load next to CPU torch, and SGLang imports `torchvision.transforms`
# at import time (multimodal configs) without using it on the paths under test; the venv gets a
# tiny import shim that raises if anything is called (see `_torchvision_shim` below).
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASE=${1:-${SGLANG_RELEASE:-0.5.23}}
ROOT=${SGLANG_ENV_DIR:-$PWD/.venv-sglang}
VENV=$ROOT/$RELEASE
STAMP=$VENV/.kvroute-ready
PY=${PYTHON:-python3}

# import-time dependencies (found by importing the modules under test one by one); transformers at
# the release's own pin (read from its metadata below)
DEPS="pyzmq msgspec pydantic numpy requests psutil orjson pybase64 packaging pillow starlette fastapi uvicorn
      tqdm ipython aiohttp dill sentencepiece setproctitle einops"
case "$RELEASE" in
  0.4.*|0.5.[0-9]|0.5.1[0-3])
    DEPS="$DEPS triton==3.3.1" ;;  # utils imports triton.runtime.cache.default_cache_dir (gone in 3.4)
  *)
    DEPS="$DEPS triton apache-tvm-ffi compressed-tensors gguf partial-json-parser" ;;
esac

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RELEASE $(sha1sum "$0" | cut -c1-12)" ]; then
  # cached: point the editable kvroute at this checkout (a CI clone lives elsewhere than the last
  # one) and add what its `test` extra gained since the venv was built (torch stays pinned)
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" \
    -e ".[test]" >/dev/null 2>&1 \
    || { echo "sglang env $RELEASE: installing kvroute[test] into the cached venv failed" >&2; exit 1; }
  echo "$VENV"
  exit 0
fi

t0=$(date +%s)
rm -rf "$VENV"
mkdir -p "$ROOT"
"$PY" -m venv "$VENV"
CONSTRAINTS=$ROOT/constraints.txt
echo "torch==2.13.0" > "$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS")
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "sglang==$RELEASE"
TRANSFORMERS=$("$VENV/bin/python" -c 'import importlib.metadata as m, re
pins = [r for r in (m.requires("sglang") or []) if re.match(r"transformers\s*==", r)]
print(re.sub(r"\s*;.*", "", pins[0]).replace(" ", "") if pins else "transformers")')
DEPS="$DEPS $TRANSFORMERS"
# shellcheck disable=SC2086
"${PIP[@]}" $DEPS
if [ "$RELEASE" = "0.5.23" ]; then
  # The real-engine lane (tests/real_engine, `pytest -m real_engine`) runs SGLang's own server from
  # this venv: everything else the release declares, less what only runs on a GPU (and less torch,
  # already pinned, and torchvision, the shim below). timm declares torchvision: installed without
  # its dependencies (it is imported for vision towers only). Read from the wheel's own metadata so
  # that a new pin is followed, not copied here.
  SERVER_DEPS=$("$VENV/bin/python" - <<'PY'
import importlib.metadata as m
from packaging.requirements import Requirement
GPU_ONLY = {
    "sglang-kernel", "flashinfer-python", "flash-attn-4", "sgl-deep-ep", "sgl-deep-gemm",
    "sgl-flash-mla", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "cuda-python",
    "humming-kernels", "quack-kernels", "tilelang", "torch-memory-saver", "torchaudio", "torchcodec",
}
SEPARATE = {"torch", "torchvision", "timm"}
out = []
for raw in m.requires("sglang") or []:
    req = Requirement(raw)
    name = req.name.lower().replace("_", "-")
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform's
    if name in GPU_ONLY or name in SEPARATE:
        continue
    req.extras = set()  # e.g. flashinfer_python[cu13]: no CUDA extras
    req.marker = None
    out.append(str(req))
print(" ".join(out))
PY
)
  # shellcheck disable=SC2086
  "${PIP[@]}" $SERVER_DEPS
  TIMM=$("$VENV/bin/python" -c 'import importlib.metadata as m, re
pins = [r for r in (m.requires("sglang") or []) if re.match(r"timm\b", r)]
print(re.sub(r"\s*;.*", "", pins[0]).replace(" ", "") if pins else "")')
  if [ -n "$TIMM" ]; then
    "${PIP[@]}" --no-deps "$TIMM"
  fi
fi
"${PIP[@]}" -e ".[test]"

_torchvision_shim() {
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/torchvision"
  cat > "$site/torchvision/__init__.py" <<'PY'
"""kvroute's import shim for torchvision (scripts/sglang_env.sh). PyPI has only CUDA builds of
torchvision, whose C ops cannot load next to CPU torch; SGLang and transformers import it for
multimodal models, which the contract tests never run. Every `torchvision.*` module imports, every
name in it is a placeholder, and calling one raises."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvroute.shim"


class _Absent:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is an import shim in kvroute's SGLang test venv")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{modname}.{name}")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
__getattr__ = _module_getattr("torchvision")
PY
}
_torchvision_shim

# the modules the contract tests use must import
"$VENV/bin/python" - "$RELEASE" <<'PY'
import importlib, sys
release = sys.argv[1]
mods = ["sglang.srt.server_args", "sglang.srt.disaggregation.kv_events"]
if tuple(int(x) for x in release.split(".")[:3]) >= (0, 5, 14):
    # older releases' KvMetrics modules call torch._C._cpu._is_amx_tile_supported at import, which
    # torch 2.13 (the only CPU torch here) no longer has: only their KV-event side runs
    mods += ["sglang.srt.managers.scheduler_components.kv_events_publisher", "sglang.srt.mem_cache.radix_cache"]
for m in mods:
    importlib.import_module(m)
PY
if [ "$RELEASE" = "0.5.23" ]; then
  # the real engine's server and scheduler import on the CPU engine, with the lane's test-only
  # sgl_kernel stand-in (tests/real_engine/cpu_kernels) on the path as the lane's engines have it
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$PWD/tests/real_engine/cpu_kernels" "$VENV/bin/python" -c \
    'import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler' 2>/dev/null \
    || { echo "sglang env $RELEASE: SGLang's server does not import on the CPU engine" >&2; exit 1; }
fi
echo "$RELEASE $(sha1sum "$0" | cut -c1-12)" > "$STAMP"
t1=$(date +%s)
echo "sglang env $RELEASE built in $((t1 - t0)) s, $(du -sh "$VENV" | cut -f1)" >&2
echo "$VENV"

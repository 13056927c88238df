"""The LoRA adapters of a simulated worker, named, loaded, resolved and refused as SGLang 0.5.23 does.

Read from 0.5.23's source (`pip download --no-deps sglang==0.5.23`):

- `--lora-paths` items are `<PATH>`, `<NAME>=<PATH>` or JSON `{"lora_name", "lora_path", "pinned"}`
  (`arg_groups/argparse_actions.LoRAPathAction`, `lora_hook`); giving any turns `--enable-lora` on.
  A preloaded adapter's id is `uuid5(NAMESPACE_URL, f"{name}\\0{path}")` (`LoRARef.deterministic_id`);
  one loaded at run time gets a fresh `uuid4().hex`.
- a request names its adapter by `model: "<base>:<adapter>"` (`serving_base._parse_model_parameter`:
  the served name followed by ":" is cut off whole, else the model splits at its first ":"; the
  base part is not checked) — which beats the body's `lora_path` (`_resolve_lora_path`). A `model`
  without ":" is the base model whatever it says: chat and completion requests never check it.
- an adapter is refused (HTTP 400) if LoRA is off ("LoRA adapter 'X' was requested, but LoRA is not
  enabled. …", `tokenizer_manager._validate_and_resolve_lora`) or if it was never loaded on this
  server ("Got LoRA adapter that has never been loaded: X\\nAll loaded adapters: dict_keys([...]).");
  one loaded once and unloaded since is loaded again implicitly (`lora_ref_cache`).
- `/load_lora_adapter` / `/unload_lora_adapter` answer `LoRAUpdateOutput` (`success`,
  `error_message`, `loaded_adapters` name → path), 400 when `success` is false.
- `/v1/models` lists each loaded adapter as `{"id": name, "root": path, "parent": <served model>}`.
- the radix cache keys a request's pages by its adapter (`Req.extra_key` += lora_id), so an
  adapter's KV is never shared with the base model's or another adapter's; KV events carry the
  adapter's name in `BlockStored.lora_name` (`lora_id` stays null) with hashes in its namespace.
- the scheduler admits a request only if the distinct adapters of the running batch, the base
  model (None) counted as one, stay within `--max-loras-per-batch` (8); others wait, not the queue.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Iterable


class LoraError(ValueError):
    """A request's adapter the server refuses with HTTP 400 (SGLang's message)."""


@dataclass(frozen=True)
class LoraRef:
    name: str
    path: str
    lora_id: str
    pinned: bool = False


def parse_lora_paths(items: Iterable[str]) -> list[LoraRef]:
    """`--lora-paths` items (`PATH`, `NAME=PATH`, or the JSON form) → adapters, as SGLang parses them."""
    out = []
    for raw in items:
        item = raw.strip()
        if item.startswith("{") and item.endswith("}"):
            obj = json.loads(item)
            if "lora_name" not in obj or "lora_path" not in obj:
                raise ValueError(f"{item!r} looks like a JSON str, but it does not contain 'lora_name' and "
                                 "'lora_path' keys.")
            name, path, pinned = str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))
        elif "=" in item:
            name, path = item.split("=", 1)
            pinned = False
        else:
            name = path = item
            pinned = False
        out.append(LoraRef(name, path, uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex, pinned))
    return out


def parse_model_parameter(model: str, served_model_name: str) -> tuple[str, str | None]:
    """`serving_base._parse_model_parameter`: `model` → (base, adapter or None)."""
    if ":" not in model or model == served_model_name:
        return model, None
    if model.startswith(f"{served_model_name}:"):
        base, adapter = served_model_name, model[len(served_model_name) + 1:]
    else:
        base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


class LoraRegistry:
    """The adapters one server has loaded (and has ever loaded), keyed by name."""

    def __init__(self, enabled: bool, paths: Iterable[LoraRef] = (), max_loras_per_batch: int = 8) -> None:
        if max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be positive")
        self.enabled = enabled
        self.max_loras_per_batch = max_loras_per_batch
        self.loaded: dict[str, LoraRef] = {}
        self._ever: dict[str, LoraRef] = {}  # SGLang's lora_ref_cache: an unloaded adapter comes back on use
        for ref in paths if enabled else ():
            self.loaded[ref.name] = self._ever[ref.name] = ref

    # ---------------------------------------------------------------- load / unload routes

    def _result(self, success: bool, error: str | None = None, *, adapters: bool = True) -> dict[str, Any]:
        """`LoRAUpdateOutput` as `msgspec_to_builtins` writes it; a refusal of the tokenizer manager
        (not of the backend) carries no `loaded_adapters`."""
        return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error,
                "loaded_adapters": {r.name: r.path for r in self.loaded.values()} if adapters else None}

    def load(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        """`/load_lora_adapter`'s answer (`success` false: HTTP 400)."""
        if not self.enabled:
            return self._result(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
                                adapters=False)
        if name in self.loaded:
            return self._result(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        ref = LoraRef(name, path, uuid.uuid4().hex, pinned)
        self.loaded[name] = self._ever[name] = ref
        return self._result(True, "")

    def unload(self, name: str) -> dict[str, Any]:
        """`/unload_lora_adapter`'s answer (`success` false: HTTP 400)."""
        if not self.enabled:
            return self._result(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.",
                                adapters=False)
        if name not in self.loaded:
            return self._result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                       f"{self.loaded.keys()}", adapters=False)
        del self.loaded[name]
        return self._result(True, "")

    # ---------------------------------------------------------------- requests

    def resolve(self, model: str | None, lora_path: Any, served_model_name: str) -> LoraRef | None:
        """The adapter a chat/completion request runs with (None: the base model); raises LoraError."""
        adapter = parse_model_parameter(model, served_model_name)[1] if model else None
        return self.acquire(adapter if adapter is not None else lora_path)

    def acquire(self, lora_path: Any) -> LoraRef | None:
        """The adapter named by a request's `lora_path` (a list: its first entry — the sim serves one
        prompt a request); an adapter unloaded since it was loaded is loaded again."""
        if isinstance(lora_path, list):
            lora_path = next((a for a in lora_path if a), None)
        if not lora_path:
            return None
        if not self.enabled:
            raise LoraError(f"LoRA adapter '{lora_path}' was requested, but LoRA is not enabled. Please launch "
                            "the server with --enable-lora flag and preload adapters using --lora-paths or "
                            "/load_lora_adapter endpoint.")
        ref = self.loaded.get(lora_path)
        if ref is None:
            ref = self._ever.get(lora_path)
            if ref is None:
                raise LoraError(f"Got LoRA adapter that has never been loaded: {lora_path}\n"
                                f"All loaded adapters: {self._ever.keys()}.")
            self.load(ref.name, ref.path, ref.pinned)  # "Reloading evicted adapter" (a new lora_id)
            ref = self.loaded[lora_path]
        return ref

    def model_cards(self, served_model_name: str, created: int) -> list[dict[str, Any]]:
        """The `/v1/models` entries of the loaded adapters."""
        if not self.enabled:
            return []
        return [{"id": r.name, "object": "model", "created": created, "owned_by": "sglang", "root": r.path,
                 "parent": served_model_name, "max_model_len": None} for r in self.loaded.values()]

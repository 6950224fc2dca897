"""The LoRA adapters a server serves, by name, as vLLM's: `--lora-modules` at start, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` at run time. Each adapter runs on one served model's engine (its base); a request whose
`model` names it runs there with the adapter's LoRARequest."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import json
import logging
from collections.abc import Iterable

from jaxserve.engine.client import EngineDeadError
from jaxserve.lora.request import LoRARequest
from jaxserve.openai.errors import ApiError
from jaxserve.server.served_model import ServedModel

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's name): NAME=PATH, or JSON {"name", "path", "base_model_name"} (the base:
    a served model's name; none: the first)."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "LoRAModulePath":
        """A ValueError that quotes the spec when it is neither form."""
        if spec.lstrip().startswith("{"):
            try:
                fields = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"--lora-modules {spec!r} is not valid JSON: {e}") from None
            unknown = set(fields) - {"name", "path", "base_model_name"} if isinstance(fields, dict) else set()
            if not isinstance(fields, dict) or unknown:
                raise ValueError(f"--lora-modules {spec!r}: a JSON entry holds name, path and base_model_name only")
            name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
        else:
            name, sep, path = spec.partition("=")
            base = None
            if not sep:
                raise ValueError(f"--lora-modules {spec!r}: give NAME=PATH or JSON "
                                 '{"name": ..., "path": ..., "base_model_name": ...}')
        if not (isinstance(name, str) and name.strip() and isinstance(path, str) and path.strip()):
            raise ValueError(f"--lora-modules {spec!r}: an adapter needs a non-empty name and path")
        if base is not None and not (isinstance(base, str) and base):
            raise ValueError(f"--lora-modules {spec!r}: base_model_name must be a served model's name")
        return cls(name, path, base)


def check_lora_modules(modules: list[LoRAModulePath], served: list[str]) -> None:
    """Before anything loads: each adapter under its own name, none a served model's, each base one of them."""
    names = [m.name for m in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--lora-modules names {', '.join(map(repr, repeated))} more than once")
    clash = sorted(set(names) & set(served))
    if clash:
        raise ValueError(f"--lora-modules {', '.join(map(repr, clash))}: already a served model's name")
    for m in modules:
        if m.base_model_name is not None and m.base_model_name not in served:
            raise ValueError(f"--lora-modules {m.name!r}: base_model_name {m.base_model_name!r} is not served "
                             f"(served: {', '.join(served)})")


@dataclasses.dataclass(frozen=True)
class ServedAdapter:
    name: str
    model: ServedModel  # its base
    lora_request: LoRARequest


class LoRAModules:
    """The server's adapters by name. Loading reads the adapter on a thread and puts it in its base engine's host
    cache (so a bad one fails here, as a 400, and the first request finds it ready); running requests go on."""

    def __init__(self, models: dict[str, ServedModel], reserved: Iterable[str] = frozenset()):
        """reserved: other names requests give as their model (a cascade's), not free for an adapter either."""
        self._models = models
        self._reserved = set(reserved)
        self.adapters: dict[str, ServedAdapter] = {}
        self._loading: set[str] = set()  # names taken by a load in progress: a second load of one is a duplicate
        self._ids = itertools.count(1)  # lora_int_id: unique over the server's life (as vLLM's counter)

    def get(self, name: str) -> ServedAdapter | None:
        return self.adapters.get(name)

    async def load(self, name, path, base_model_name=None) -> ServedAdapter:
        """vLLM's load_lora_adapter: a 400 for a missing field, a duplicate name or an adapter the loader refuses
        (its message), a 404 for an unknown base model."""
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_name" if not (isinstance(name, str) and name) else "lora_path")
        if name in self.adapters or name in self._loading:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name in self._models or name in self._reserved:
            raise ApiError(400, f"'{name}' is a served model's name, not free for an adapter", "lora_name")
        model = self._base(base_model_name)
        if not model.engine.enable_lora:
            raise ApiError(400, f"the model '{model.name}' serves no adapters: start the server with --enable-lora")
        request = LoRARequest(name, next(self._ids), path)
        self._loading.add(name)
        try:
            await _off_loop(model.engine.add_lora, request)
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from None
        except ValueError as e:  # LoRAError (a ValueError) names the adapter and the field
            raise ApiError(400, str(e), "lora_path") from None
        except OSError as e:  # its text names files and why they failed: the log's, not the client's
            logger.warning("LoRA adapter %r (%s) refused: %s", name, path, e)
            raise ApiError(400, f"LoRA adapter '{name}' ({path}): not found, not readable, or not a PEFT LoRA "
                                "adapter (a directory of adapter_config.json and adapter_model.safetensors)",
                           "lora_path") from None
        finally:
            self._loading.discard(name)
        adapter = self.adapters[name] = ServedAdapter(name, model, request)
        model.metrics.add_adapter(name)
        return adapter

    async def unload(self, name) -> None:
        """vLLM's unload_lora_adapter: new requests naming it are 404s from now; running ones finish with it."""
        if not (isinstance(name, str) and name):
            raise ApiError(400, "'lora_name' must be provided.", "lora_name")
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        adapter.model.metrics.remove_adapter(name)
        try:
            await _off_loop(adapter.model.engine.remove_lora, adapter.lora_request.lora_int_id)
        except EngineDeadError as e:
            raise ApiError(503, str(e)) from None

    def _base(self, base_model_name) -> ServedModel:
        if base_model_name is None:
            return next(iter(self._models.values()))  # vLLM's: the first served model
        model = self._models.get(base_model_name) if isinstance(base_model_name, str) else None
        if model is None:
            raise ApiError(404, f"The model `{base_model_name}` does not exist", "base_model_name", "model_not_found")
        return model


async def _off_loop(fn, *args):
    """fn(*args) without blocking the event loop: awaited if it is a coroutine function, else on a thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

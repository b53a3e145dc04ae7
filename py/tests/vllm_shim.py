"""Import vLLM's own KV-event and block-hashing modules without torch.

vLLM's package ``__init__`` (and most of the modules on the way to the ones the tests need)
import torch, which the tests do not need and CI does not install: vLLM is installed with
``pip install --no-deps vllm==0.33.0`` plus the light packages in ``py/requirements-vllm.txt``.

:func:`load` installs a meta-path finder (the technique of ``fixtures/hash-vectors/generate.py``)
that loads a few modules from the installed wheel **unmodified**:

- ``vllm.distributed.kv_events`` (``ZmqEventPublisher``, ``KVEventBatch``, ``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``),
- ``vllm.utils.hashing`` (``get_hash_fn_by_name``),
- ``vllm.v1.core.kv_cache_utils`` (``init_none_hash``, ``hash_block_tokens``,
  ``maybe_convert_block_hash``), with ``vllm.envs`` and ``vllm.utils.math_utils`` they import,

registers the packages on the way to them as empty packages whose ``__path__`` is the real
installed directory (so ``vllm/__init__.py`` never runs), and every other ``vllm.*`` module as a
permissive stub: those are only referenced by imports, type annotations and code paths the tests
never run (the publisher's config record, the ``tcp://*:0`` node-IP helpers, the scheduler's
request class). ``vllm.logger.init_logger`` is :func:`logging.getLogger`.

When torch is importable (a full vLLM install), the modules are imported normally instead.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The vLLM release the tests were written against (``py/requirements-vllm.txt``).
VLLM_VERSION = "0.33.0"

#: Modules loaded from the installed wheel, unmodified.
_REAL_MODULES = frozenset(
    {
        "vllm.envs",
        "vllm.distributed.kv_events",
        "vllm.utils.hashing",
        "vllm.utils.math_utils",
        "vllm.v1.core.kv_cache_utils",
    }
)
#: Packages on the way to the real modules: empty, with the real ``__path__``.
_REAL_PARENTS = frozenset(
    ".".join(name.split(".")[:i]) for name in _REAL_MODULES for i in range(1, name.count(".") + 1)
)


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class _Stub(metaclass=_StubMeta):
    """Placeholder for any name imported from a stubbed module: callable, subscriptable, and
    every attribute is another placeholder."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> Any:
        return cls

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub()


def _stub_class(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``vllm`` and ``vllm.*`` imports: real modules fall through to the normal path
    finder, their parent packages are empty packages with the real ``__path__``, the rest stubs."""

    def __init__(self, root_dir: str) -> None:
        self.root_dir = root_dir

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        if fullname in _REAL_MODULES:
            return None  # the normal path finder loads the real file from the parent's __path__
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname in _REAL_PARENTS:
            spec.submodule_search_locations = [os.path.join(self.root_dir, *fullname.split(".")[1:])]
        else:
            spec.submodule_search_locations = []
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name in _REAL_PARENTS:
            return
        if name == "vllm.logger":
            module.init_logger = logging.getLogger  # type: ignore[attr-defined]
            return

        def __getattr__(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = _stub_class(attr)
            setattr(module, attr, value)
            return value

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


@dataclass(frozen=True)
class Vllm:
    """The loaded vLLM modules (typed ``Any``: vLLM is not type-checked here)."""

    version: str
    kv_events: Any
    hashing: Any
    kv_cache_utils: Any
    #: True when vLLM was imported normally (torch present), False when through the shim.
    native: bool


_loaded: Vllm | None = None


def load() -> Vllm:
    """Import vLLM's modules (once per process).

    Raises:
        ImportError: vLLM (or one of the light packages in ``py/requirements-vllm.txt``) is not
            installed; the message says what is missing.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            "vllm is not installed (pip install -r py/requirements-vllm.txt && "
            f"pip install --no-deps vllm=={VLLM_VERSION})"
        ) from None
    for dep in ("msgspec", "zmq", "cbor2", "xxhash"):
        if importlib.util.find_spec(dep) is None:
            raise ImportError(f"{dep} is not installed (pip install -r py/requirements-vllm.txt)")
    native = importlib.util.find_spec("torch") is not None
    if not native and "vllm" not in sys.modules:
        spec = importlib.util.find_spec("vllm")  # locates the package without running __init__
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("vllm is installed but its package directory was not found")
        sys.meta_path.insert(0, _VllmFinder(list(spec.submodule_search_locations)[0]))
    _loaded = Vllm(
        version=version,
        kv_events=importlib.import_module("vllm.distributed.kv_events"),
        hashing=importlib.import_module("vllm.utils.hashing"),
        kv_cache_utils=importlib.import_module("vllm.v1.core.kv_cache_utils"),
        native=native,
    )
    return _loaded

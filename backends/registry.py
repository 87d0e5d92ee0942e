"""Create stage backends by name, lazily, on the calling thread.

Names: ``"torch"`` (CUDA > MPS > CPU unless ``device`` says otherwise),
``"mlx"`` (Metal on Apple silicon, CPU elsewhere) and ``"auto"`` (MLX on an
Apple-silicon Mac when installed, else torch). Nothing here imports torch or
mlx until a backend is actually created or probed.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys

from backends.base import BackendUnavailable, StageBackend

#: environment variable capping torch's intra-op threads in every TorchStage of the process
#: (several nodes on one machine should split its cores rather than each take all of them)
TORCH_THREADS_ENV = "POLIS_TORCH_THREADS"

#: backend name -> (module, class name, python package that must be importable)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "torch": ("backends.torch_stage", "TorchStage", "torch"),
    "mlx": ("backends.mlx_stage", "MLXStage", "mlx"),
}


def names() -> list[str]:
    return list(_BACKENDS)


def unavailable_reason(name: str) -> str | None:
    """``None`` if backend ``name`` can be created here, else a reason in words."""
    if name not in _BACKENDS:
        return f"unknown backend '{name}' (choose from {', '.join(_BACKENDS)} or auto)"
    _, _, package = _BACKENDS[name]
    if importlib.util.find_spec(package) is None:
        hint = 'pip install "mlx[cpu]"' if name == "mlx" and sys.platform != "darwin" else f"pip install {package}"
        return f"{package} is not installed ({hint})"
    return None


def available() -> list[str]:
    return [n for n in _BACKENDS if unavailable_reason(n) is None]


def resolve(name: str = "auto") -> str:
    """Turn ``auto`` into a concrete backend name available on this machine."""
    if name != "auto":
        reason = unavailable_reason(name)
        if reason:
            raise BackendUnavailable(f"backend '{name}' is unavailable: {reason}")
        return name
    apple_silicon = sys.platform == "darwin" and platform.machine() == "arm64"
    order = ["mlx", "torch"] if apple_silicon else ["torch", "mlx"]
    for candidate in order:
        if unavailable_reason(candidate) is None:
            return candidate
    raise BackendUnavailable("no backend available: install torch (or mlx on a Mac)")


def create(name: str = "auto", device: str | None = None) -> StageBackend:
    """Instantiate a backend on the current thread. ``device`` e.g. ``"cpu"``, ``"cuda:1"``."""
    concrete = resolve(name)
    module_name, class_name, _ = _BACKENDS[concrete]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(device=device)

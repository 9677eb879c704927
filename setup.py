"""Builds the native recording core (tether/csrc/*.cpp) against the installed torch.

Install with ``pip install --no-build-isolation .`` (the Makefile does): the core is compiled
against the torch already in the environment, as torch extensions are. Without torch there, or
without a C++ compiler, tether installs without the core and records with its Python recorder
(``tether doctor`` says which is active, and why).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup


def _native_name() -> str:
    """The core's module name for the installed torch (tether/_versions.py, loaded by path: the
    package itself is not importable while it is being built)."""
    spec = importlib.util.spec_from_file_location("_tether_versions", "tether/_versions.py")
    assert spec is not None and spec.loader is not None
    versions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(versions)
    return versions.native_module()


def _native() -> tuple[list, dict]:
    if os.environ.get("TETHER_BUILD_NATIVE", "1") == "0":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "tether: torch is not importable while building, so the native recording core is "
            "not built (install torch first, then tether with --no-build-isolation)",
            file=sys.stderr,
        )
        return [], {}

    name = _native_name()

    class OptionalBuild(BuildExtension):
        """A core that fails to build leaves tether installed with its Python recorder."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                print(
                    f"tether: the native recording core did not build ({exc}); tether will "
                    "record with its Python recorder. `tether doctor` shows this.",
                    file=sys.stderr,
                )

    # optional: an editable install copies nothing back for an extension that did not build
    # (otherwise pip fails on the missing file, and tether is not installed at all).
    # Every unit in tether/csrc (ring file, stacks, core, backend, bindings), sorted: a build
    # whose sources come in another order is the same build.
    csrc = Path("tether/csrc")
    sources = sorted(str(p) for p in csrc.glob("*.cpp"))
    headers = sorted(str(p) for p in csrc.glob("*.h"))
    ext = CppExtension(name, sources, depends=headers, extra_compile_args=["-O2"], optional=True)
    return [ext], {"build_ext": OptionalBuild}


modules, commands = _native()
setup(ext_modules=modules, cmdclass=commands)

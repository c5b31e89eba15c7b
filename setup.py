"""The kernel library (constrained_spec/model/csrc/), built when the package is: once per
instruction-set variant of this machine's architecture (constrained_spec/model/isa.py), in
parallel, beside the package (in place for an editable install, into the wheel otherwise). A C++
compiler is all it needs: torch is no build requirement (pip's isolated build would fetch a
multi-GB CUDA build). Without a compiler the install still succeeds, with one warning; the
layers then run as torch ops, and say so once."""

import importlib.util
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent
PACKAGE = Path("constrained_spec", "model")


def load_isa():
    """constrained_spec/model/isa.py by its path: the package's __init__ imports torch."""
    spec = importlib.util.spec_from_file_location(
        "_constrained_spec_isa", ROOT / PACKAGE / "isa.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


isa = load_isa()


class build_kernels(Command):
    """Compile every variant of this architecture (a build sub-command, PEP 660-aware)."""

    description = "compile the kernel library once per instruction-set variant"
    user_options = []
    editable_mode = False

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _built(self) -> dict[str, Path]:  # variant name → its library in build_lib
        folder = Path(self.build_lib) / PACKAGE / "libs"
        return {v.name: folder / isa.library_name(v.name) for v in isa.variants()}

    def get_outputs(self):
        return [str(path) for path in self._built().values()]

    def get_output_mapping(self):  # an editable install builds them in place
        if not self.editable_mode:
            return {}
        return {str(path): str(PACKAGE / "libs" / path.name) for path in self._built().values()}

    def get_source_files(self):
        return [str(p.relative_to(ROOT)) for p in [*isa.SOURCES, *isa.HEADERS]]

    def run(self):
        in_place = ROOT if self.editable_mode else Path(self.build_lib)
        folder = in_place / PACKAGE / "libs"
        if not self.editable_mode:  # a wheel holds what this build built, not an earlier one's
            for old in folder.glob(f"{isa.PREFIX}*"):
                old.unlink()
        cxx, variants = isa.compiler(), isa.variants()
        if cxx is None or not variants:  # (pip shows this with -v; at run time one line says it)
            why = "no C++ compiler found" if variants else f"no variants for {isa.architecture()}"
            self.warn(f"the kernel library is not built ({why}): the layers will run as torch ops")
            return
        with ThreadPoolExecutor(min(len(variants), os.cpu_count() or 1)) as pool:
            failed = [f for f in pool.map(lambda v: self._one(cxx, v, folder), variants) if f]
        if failed:
            self.warn(
                f"kernel variants not built (those CPUs run the next one down): {'; '.join(failed)}"
            )

    def _one(self, cxx, variant, folder: Path) -> str | None:
        """Build one variant; in place (editable), not again where its library is there from
        the same sources and command (a stamp beside it)."""
        library, stamp = folder / isa.library_name(variant.name), isa.stamp(cxx, variant)
        record = folder / f".{library.name}.stamp"
        fresh = library.is_file() and record.is_file() and record.read_text() == stamp
        if self.editable_mode and fresh:
            return None
        if why := isa.build(variant, library, cxx):
            return f"{variant.name}: {why}"
        if self.editable_mode:
            record.write_text(stamp)
        return None


class platform_distribution(Distribution):
    """Machine code inside: the wheel is a platform's (built per platform, installed as platlib)."""

    def has_ext_modules(self):
        return True


build.sub_commands.append(("build_kernels", None))
commands = {"build_kernels": build_kernels}
try:  # tagged for this platform and any Python 3: the libraries use no CPython ABI
    from setuptools.command.bdist_wheel import bdist_wheel

    class platform_wheel(bdist_wheel):
        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    commands["bdist_wheel"] = platform_wheel
except ImportError:  # setuptools < 70.1: the wheel package's bdist_wheel, tagged for CPython
    pass

setup(cmdclass=commands, distclass=platform_distribution)

"""Build of the compiled planner core, ``mmbalance._core`` (C++17, pybind11, no torch)."""

import glob
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# the translation units compile in parallel, one job a CPU (MMBALANCE_BUILD_JOBS=N to choose)
ParallelCompile("MMBALANCE_BUILD_JOBS", default=0).install()

extra = ["-O3", "-fvisibility=hidden"] if sys.platform != "win32" else ["/O2"]

ext_modules = [
    Pybind11Extension(
        "mmbalance._core",
        sorted(glob.glob("csrc/*.cpp")),
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=extra,
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})

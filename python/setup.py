"""Build hook: ship a copy of libkvferry.so inside the package when one is at
hand ($KVFERRY_LIB, else the checkout's ../build/libkvferry.so), so an
installed kvferry finds its library next to itself. Without one the package
installs alone and finds the library on the system path (`make install`)."""

import os
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _library():
    lib = os.environ.get("KVFERRY_LIB") or os.path.join(HERE, "..", "build", "libkvferry.so")
    return os.path.realpath(lib) if os.path.exists(lib) else None


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        lib = _library()
        if lib:
            dst = os.path.join(self.build_lib, "kvferry", "libkvferry.so")
            shutil.copyfile(lib, dst)
            os.chmod(dst, 0o755)
            print(f"kvferry: bundled {lib}")
        else:
            print("kvferry: no libkvferry.so to bundle; the package will look for an installed one")


class LibDistribution(Distribution):
    def has_ext_modules(self):  # the wheel holds a native library: tag it for this platform
        return _library() is not None


setup(cmdclass={"build_py": BuildPyWithLib}, distclass=LibDistribution)

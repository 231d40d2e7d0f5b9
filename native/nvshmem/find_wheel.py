"""Print where the nvidia-nvshmem wheel's headers and libraries are, for native/nvshmem/CMakeLists.txt.

Run by CMake with the interpreter scikit-build-core builds for. Prints one line
``<dir>|<distribution> <version>`` (``<dir>`` holds include/ and lib/), or nothing when the
wheel is not importable. ``nvidia.nvshmem`` is a namespace package (no ``__init__.py``, no
``__file__``), so the directory comes from its spec's search locations.
"""

import importlib.metadata
import importlib.util
import os


def main() -> None:
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        spec = None
    for base in list(spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(base, "include", "nvshmem_host.h")):
            dist = ""
            for name in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
                try:
                    dist = f"{name} {importlib.metadata.version(name)}"
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
            print(f"{os.path.realpath(base)}|{dist}")
            return


if __name__ == "__main__":
    main()

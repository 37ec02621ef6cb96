"""Build script for stitchcuda.

The repository keeps the design card's top-level folders (``stitch_backend/``,
``agents/``, ``cache/``, ``csrc/``), but generic names such as ``agents`` or ``cache``
must not land at the top of site-packages, so everything installs under the single
``stitch_backend`` namespace:

    stitch_backend         <- stitch_backend/
    stitch_backend.agents  <- agents/
    stitch_backend.cache   <- cache/
    stitch_backend.csrc    <- csrc/   (CUDA C++ sources shipped as package data)
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _version() -> str:
    for line in (HERE / "stitch_backend" / "version.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip('"')
    raise RuntimeError("stitch_backend/version.py has no __version__")


def _mapped(prefix: str, folder: str) -> dict[str, str]:
    """Map ``folder`` and its sub-packages to ``prefix`` and its sub-packages."""
    mapping = {prefix: folder}
    for sub in find_packages(where=folder):
        mapping[f"{prefix}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return mapping


package_dir = {}
package_dir.update(_mapped("stitch_backend", "stitch_backend"))
package_dir.update(_mapped("stitch_backend.agents", "agents"))
package_dir.update(_mapped("stitch_backend.cache", "cache"))
package_dir["stitch_backend.csrc"] = "csrc"

setup(
    name="stitchcuda",
    version=_version(),
    description="A PyTorch compiler backend that stitches verified, fused CUDA kernels",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=sorted(package_dir),
    package_dir=package_dir,
    package_data={
        "stitch_backend.csrc": ["*.cuh", "*.cu", "*.h", "*/*.cuh", "*/*.cu", "*/*.h"],
        "stitch_backend": ["examples/*.py", "agents/prompts/*"],
        "stitch_backend.agents": ["prompts/*.txt", "prompts/*.j2"],
    },
    install_requires=[
        # 2.11 is the GPU image's torch; the CPU CI machine uses 2.13.
        "torch>=2.11",
        "numpy",
        "tqdm>=4.60",   # progress bars with a delay
    ],
    extras_require={
        "test": ["pytest>=7", "openai>=1.0"],
        "llm": ["openai>=1.0"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "torch_dynamo_backends": ["stitchcuda = stitch_backend.backend:stitchcuda"],
        "console_scripts": ["stitchcuda = stitch_backend.cli:main"],
    },
)

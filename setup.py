"""Package layout (metadata lives in pyproject.toml).

One import root, `jaxdecode`, built from four source folders. Every subpackage of each folder is found
by `find_packages`, so a new subpackage ships without being listed anywhere (tests/test_wheel.py checks
this and builds a wheel). models/embedded holds data only (the shipped models): it ships as package data
of jaxdecode.models, and `include_package_data=False` keeps setuptools from treating its folders as
would-be packages.
"""
from __future__ import annotations

from pathlib import Path

# import name -> source folder (relative to this file)
ROOTS = {
    "jaxdecode": "jaxdecode",
    "jaxdecode.models": "models",
    "jaxdecode.training": "training",
    "jaxdecode.kernels": "pallas_kernels",
}

PACKAGE_DATA = {"jaxdecode.models": ["embedded/**/*"]}


def discover_packages(root: Path | str = Path(__file__).resolve().parent) -> tuple[list[str], dict[str, str]]:
    """(packages, package_dir): each root and every subpackage (folder with an __init__.py) below it."""
    from setuptools import find_packages
    root = Path(root)
    packages = []
    for name, folder in ROOTS.items():
        if not (root / folder / "__init__.py").exists():
            raise FileNotFoundError(f"package root {name} expects {root / folder / '__init__.py'}")
        packages += [name] + [f"{name}.{sub}" for sub in find_packages(str(root / folder))]
    return packages, dict(ROOTS)


if __name__ == "__main__":  # as run by the build backend (setup.py is also imported by the tests)
    from setuptools import setup

    packages, package_dir = discover_packages()
    setup(packages=packages, package_dir=package_dir, package_data=PACKAGE_DATA,
          include_package_data=False)

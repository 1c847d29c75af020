"""What someone adopting the project looks for: a license the metadata names,
typed package data, a changelog, and the supported Python stated."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_license_is_apache_2_and_the_metadata_says_so() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a pointer to it
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert project["requires-python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"]


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "talaria" / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["talaria"]


def test_changelog_and_supported_python_in_readme() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and "## [0.1.0]" in changelog
    readme = (ROOT / "README.md").read_text()
    assert "Python 3.11 or newer" in readme
    assert "Apache-2.0" in readme


def test_the_images_copy_every_file_the_package_build_reads() -> None:
    # `pip install .` in the image reads the readme and the license files pyproject names
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {project["readme"], *project["license-files"]}
    for dockerfile in ("deploy/Dockerfile", "deploy/Dockerfile.vllm"):
        copied: set[str] = set()
        for line in (ROOT / dockerfile).read_text().splitlines():
            if line.startswith("COPY "):
                copied.update(line.split()[1:-1])
        assert needed <= copied, (dockerfile, needed - copied)

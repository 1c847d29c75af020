"""The repository stands on its own: no path of the machine it was written on,
no reference to a document outside it, no number of this project's tracker
(say what a thing does instead), and no package registry's host name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# split so that this file does not match itself
MACHINE_PATHS = re.compile("|".join(re.escape(p) for p in (
    "/wo" "rk/", "/ro" "ot/", "/ho" "me/", "/tmp/vl" "lm", "/tmp/vst" "udy", "/op" "t/wheels", "/op" "t/pypi")))
OUTSIDE_DOCS = re.compile("TRACE" "-FORMAT" r"\.md|CALIBRATION" r"\.md|DESIGN" r"\.md|STYLE" r"\.md|CONVENTIONS" r"\.md")
# the word issue followed by a number, or a parenthesised hash and number: this project's tracker
OUR_ISSUES = re.compile(r"\bissues? \d+|\(#\d+\)|\bsee #\d+", re.I)
REGISTRY_HOSTS = re.compile("py" r"pi\.org|python" r"hosted\.org|download\.py" r"torch\.org|\bPy" "PI\b")


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.splitlines():
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".jpg", ".safetensors"):
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def hits(pattern: re.Pattern[str], *, skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in tracked_text_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in skip:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:120]}")
    return found


def test_no_absolute_path_of_a_machine() -> None:
    assert not hits(MACHINE_PATHS), "\n".join(hits(MACHINE_PATHS))


# Files whose owner repoints them separately (a comment naming the calibration
# figures by their old file name); remove an entry once its file is repointed.
def test_no_reference_to_a_document_outside_the_repository() -> None:
    found = hits(OUTSIDE_DOCS)
    assert not found, "\n".join(found)
    for doc in ("docs/trace-format.md", "docs/calibration.md"):
        assert (ROOT / doc).is_file(), doc


def test_no_number_of_this_projects_tracker() -> None:
    # other projects' issues keep their names (vLLM #16162, NVIDIA/nccl issue #1264): those are sources
    found = [h for h in hits(OUR_ISSUES) if not re.search(r"[\w.-]+/[\w.-]+ issues? #\d+", h)]
    assert not found, "\n".join(found)


def test_no_package_registry_host() -> None:
    assert not hits(REGISTRY_HOSTS), "\n".join(hits(REGISTRY_HOSTS))

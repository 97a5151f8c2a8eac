"""What the lent GPU machine will have: its image (perf/device_image.txt) and the wheels
`make gpu-wheels` carries (GPU_WHEELS). The device has no network, so a dependency that is in
neither stops `trillm serve` and pytest there; `make gpu-rehearsal` runs the whole check in a
venv of only these, and these tests catch the common case in `make test`."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))

from device_image import (  # noqa: E402 - perf/ is scripts, not a package
    IMAGE_LIST,
    MissingOnImageError,
    image_packages,
    normalize,
    requirements,
)


def gpu_wheels() -> list[str]:
    """GPU_WHEELS as the Makefile sets it (backslash continuations joined)."""
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(r"^GPU_WHEELS :=(.*)$", makefile, re.MULTILINE)
    assert match, "the Makefile sets no GPU_WHEELS"
    return match.group(1).split()


def project_dependencies() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [
        re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0] for d in pyproject["project"]["dependencies"]
    ]


def test_every_dependency_is_on_the_device_image_or_carried() -> None:
    available = set(image_packages()) | {normalize(n) for n in gpu_wheels()}
    lacking = [d for d in project_dependencies() if normalize(d) not in available]
    assert lacking == [], (
        f"{lacking}: the GPU machine has neither; add them to GPU_WHEELS (Makefile) so that "
        "`make gpu-wheels` carries them, and run `make gpu-rehearsal`"
    )


def test_every_carried_wheel_finds_what_it_needs_on_the_image_or_carried() -> None:
    """They are installed with --no-deps there: what they require must be there already."""
    wanted = requirements(gpu_wheels())
    assert "torch==2.13.0" in wanted  # the CPU build, never the image's CUDA 2.11.0
    assert "attrs" in wanted  # trio's and outcome's: on the image, so not carried


def test_a_carried_wheel_that_needs_what_the_image_lacks_is_refused(tmp_path: Path) -> None:
    image = tmp_path / "image.txt"
    image.write_text("# an image without attrs\ntorch==2.11.0  torch==2.13.0\nidna\n")
    with pytest.raises(
        MissingOnImageError,
        match=r"the carried wheel outcome needs attrs, which the device image lacks: add attrs "
        r"to GPU_WHEELS",
    ):
        requirements(["trio", "outcome", "sniffio", "sortedcontainers"], image)


def test_the_image_list_parses_and_each_rehearsal_requirement_is_its_own_package() -> None:
    packages = image_packages(IMAGE_LIST)
    assert len(packages) > 150  # KINDS.md's list, not a subset
    assert packages["torch"].version == "2.11.0" and packages["triton"].version == "3.6.0"
    for name, package in packages.items():
        if package.rehearse:
            assert normalize(re.split(r"[<>=!~]", package.rehearse)[0]) == name


def test_a_malformed_line_says_where(tmp_path: Path) -> None:
    image = tmp_path / "image.txt"
    image.write_text("numpy\ntorch 2.11 2.13\n")
    with pytest.raises(ValueError, match=r"image.txt:2: want NAME\[==VERSION\] \[REQUIREMENT\]"):
        image_packages(image)

"""The lent GPU machine's image (perf/device_image.txt), for `make gpu-rehearsal` and its test.

The device has no network: what trillm needs there is either on its image or carried as a
wheel (`make gpu-wheels`). The rehearsal builds a venv of only those on this CPU machine and
runs `gpu_check.sh --dry-run` in it, so a new dependency fails here first. Standard library
only: it runs under the rehearsal venv's interpreter as well as the project's.

    python perf/device_image.py requirements NAME...  # what the rehearsal installs from the
                                                      # image, NAME... the carried wheels
    python perf/device_image.py check NAME...         # this interpreter holds only the image's
                                                      # packages and NAME...
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

IMAGE_LIST = Path(__file__).resolve().parent / "device_image.txt"
# What any venv holds besides its packages (pip's own; setuptools for `python -m venv` on 3.11).
VENV_TOOLS = frozenset({"pip", "setuptools", "wheel"})


def normalize(name: str) -> str:
    """PEP 503's name: `posix_ipc`, `Posix-IPC` and `posix-ipc` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class ImagePackage:
    """One package of the image: its version there (None: not read) and what the rehearsal
    installs in its place (None: nothing; no trillm code imports it)."""

    name: str
    version: str | None
    rehearse: str | None


def image_packages(path: Path = IMAGE_LIST) -> dict[str, ImagePackage]:
    """The image's packages by normalised name."""
    packages = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        if len(line) > 2:
            raise ValueError(f"{path}:{number}: want NAME[==VERSION] [REQUIREMENT], got {raw!r}")
        name, _, version = line[0].partition("==")
        packages[normalize(name)] = ImagePackage(
            normalize(name), version or None, line[1] if len(line) == 2 else None
        )
    return packages


class MissingOnImageError(RuntimeError):
    """A carried wheel needs a package that is neither on the image nor carried."""


def requirements(carried: list[str], path: Path = IMAGE_LIST) -> list[str]:
    """The pip requirements of the rehearsal's image packages, and of the image packages the
    carried wheels need (they are installed with --no-deps, there and here), as this
    interpreter's installed copies of them declare.

    Raises:
        MissingOnImageError: a carried wheel needs a package the device would not have.
    """
    from packaging.requirements import Requirement  # the project's venv, not the rehearsal's

    image = image_packages(path)
    wanted = {name: p.rehearse for name, p in image.items() if p.rehearse}
    carried_names = {normalize(n) for n in carried}
    for name in sorted(carried_names):
        for line in metadata.requires(name) or []:
            need = Requirement(line)
            if need.marker is not None and not need.marker.evaluate({"extra": ""}):
                continue  # an extra's, or another Python's or platform's
            dep = normalize(need.name)
            if dep in carried_names or dep in wanted:
                continue
            if dep not in image:
                raise MissingOnImageError(
                    f"the carried wheel {name} needs {dep}, which the device image lacks: add "
                    f"{dep} to GPU_WHEELS (Makefile), so that `make gpu-wheels` carries it"
                )
            version = image[dep].version
            wanted[dep] = f"{dep}=={version}" if version else dep
    return list(wanted.values())


def foreign_packages(carried: list[str], path: Path = IMAGE_LIST) -> list[str]:
    """Installed distributions (`name==version`) that are neither on the image nor carried."""
    allowed = set(image_packages(path)) | {normalize(n) for n in carried} | VENV_TOOLS
    installed = {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}
    return sorted(f"{n}=={v}" for n, v in installed.items() if n not in allowed)


def main(argv: list[str]) -> int:
    if argv[:1] == ["requirements"]:
        try:
            print(" ".join(requirements(argv[1:])))
        except MissingOnImageError as exc:
            print(f"device_image.py: {exc}", file=sys.stderr)
            return 1
        return 0
    if argv[:1] == ["check"]:
        foreign = foreign_packages(argv[1:])
        if foreign:
            print(
                f"device_image.py: {sys.prefix} holds packages the device lacks: "
                f"{', '.join(foreign)}. pip brought them for a rehearsal requirement: pin that "
                "requirement to the image's version in perf/device_image.txt, or add the "
                "package to GPU_WHEELS (Makefile) if trillm needs it",
                file=sys.stderr,
            )
            return 1
        print(f"device_image.py: {sys.prefix} holds only the image's and the carried packages")
        return 0
    print("usage: device_image.py requirements|check CARRIED_NAME...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Which of the GPU kit's wheels to install here: every one that fits this Python; one that does not fit
(a cp312 grpcio on another Python) must already be installed at least as new, or this says so and fails.

    python3 deploy/gpu/kit_wheels.py KIT_DIR    # prints the wheel paths to install, one a line
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version


def choose(kit: Path) -> tuple[list[Path], list[str]]:
    """(wheels to install, problems): a wheel that fits this interpreter is installed; one that does
    not is a problem unless the installed distribution is at least its version."""
    supported = set(sys_tags())
    install, problems = [], []
    for wheel in sorted(kit.glob("*.whl")):
        name, wanted, _, tags = parse_wheel_filename(wheel.name)
        if tags & supported:
            install.append(wheel)
            continue
        try:
            have = Version(version(name))
        except PackageNotFoundError:
            problems.append(f"{wheel.name} does not fit Python {sys.version.split()[0]} and {canonicalize_name(name)} is not installed")
            continue
        if have < wanted:
            problems.append(f"{wheel.name} does not fit this Python and the installed {name} {have} is older")
    return install, problems


def main() -> None:
    kit = Path(sys.argv[1])
    if not any(kit.glob("*.whl")):
        sys.exit(f"no wheels in {kit}: run `make gpu-kit` where pip can reach a package index")
    install, problems = choose(kit)
    if problems:
        sys.exit("GPU kit: " + "; ".join(problems))
    print("\n".join(str(w) for w in install))


if __name__ == "__main__":
    main()

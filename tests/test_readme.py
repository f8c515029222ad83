"""README.md's "Where things live" is the tree: every module of both tiers is named in its tables, and every file
they name exists (a row names a path, then files beside it by their names alone)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIERS = ("llm_server", "snac_server")


def named_in_readme() -> set[Path]:
    section = (REPO / "README.md").read_text().split("## Where things live", 1)[1].split("\n## ", 1)[0]
    named: set[Path] = set()
    for row in section.splitlines():
        cells = row.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith(tuple(f"`{t}/" for t in TIERS)):
            continue
        files = re.findall(r"`([\w./-]+\.(?:py|json))`", cells[1])
        if not files:  # a room's row in the top table
            continue
        first = Path(files[0])
        named |= {first, *(first.parent / name for name in files[1:])}
    return named


def test_where_things_live_names_every_module_and_only_what_exists():
    named = named_in_readme()
    modules = {path.relative_to(REPO) for tier in TIERS for path in (REPO / tier).rglob("*.py")}
    # The rooms' __init__.py describe their rooms; the generated-stub-free tiers have no other unnamed files.
    rooms = {m for m in modules if m.name == "__init__.py" and m.parent.name not in TIERS}
    assert len(named) > 40, "the tables were read"
    assert not {p for p in named if not (REPO / p).is_file()}, "named but missing"
    assert not (modules - rooms) - named, f"modules the README does not place: {sorted(map(str, (modules - rooms) - named))}"

"""Print the requirements of the package and of some of its extras, one per line, from pyproject.toml.

    python scripts/requirements.py test > requirements.txt

The Makefile's environments that run the tests against another transformers release install
these (and that release) without building the package: the tests import it from the checkout,
whose compiled core the main environment has built.
"""

from __future__ import annotations

import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pathlib import Path


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    name, optional = project["name"], project.get("optional-dependencies", {})
    out: list[str] = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has {', '.join(sorted(optional))})")
        seen.add(extra)
        for req in optional[extra]:
            if req.startswith(f"{name}["):  # another extra of this package
                todo += [e.strip() for e in req[len(name) + 1 : req.index("]")].split(",")]
            else:
                out.append(req)
    return list(dict.fromkeys(out))


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))

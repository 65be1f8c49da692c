"""Layer one virtual environment on another: ``python scripts/layer_venv.py NEW BASE``.

Run by the Makefile right after ``python -m venv NEW``. NEW sees BASE's packages after its own (a
``base.pth`` in NEW's site-packages names BASE's), so pip in NEW takes what BASE already satisfies
from there and installs only what NEW needs differently, which then shadows BASE's copy. BASE's
console scripts (``torchrun``, say) get wrappers in NEW's ``bin`` that run them with NEW's
interpreter, as pip would have written them had it installed the package in NEW: a program that
starts ``torchrun`` from NEW's ``PATH`` gets workers that see NEW's packages.
"""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path

WRAPPER = """#!{python}
# console script of {dist} (installed in {base}), run with this environment's interpreter
import sys
from {module} import {head}
if __name__ == "__main__":
    sys.argv[0] = sys.argv[0].removesuffix(".exe")
    sys.exit({call}())
"""


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"layer_venv: {venv} has {len(found)} site-packages folders, not one: {found}")
    return found[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python scripts/layer_venv.py NEW_VENV BASE_VENV")
    new, base = (Path(a).resolve() for a in argv)
    if Path(sys.prefix).resolve() != new:
        raise SystemExit(f"layer_venv: run it with {new}/bin/python, not {sys.executable}")
    base_lib = site_packages(base)
    Path(sysconfig.get_paths()["purelib"], "base.pth").write_text(f"{base_lib}\n")
    bin_dir = new / "bin"
    written = 0
    for dist in metadata.distributions(path=[str(base_lib)]):
        for ep in dist.entry_points.select(group="console_scripts"):
            target = bin_dir / ep.name
            if target.exists() or not ep.attr:  # its own script; a console script names a function
                continue
            target.write_text(
                WRAPPER.format(
                    python=new / "bin" / "python",
                    dist=dist.metadata["Name"],
                    base=base,
                    module=ep.module,
                    head=ep.attr.split(".")[0],
                    call=ep.attr,
                )  # fmt: skip
            )
            target.chmod(0o755)
            written += 1
    print(f"layer_venv: {new.name} sees {base_lib} after its own packages; {written} console scripts wrapped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Print a pip constraints file pinning every runtime requirement of pyproject.toml to its floor (``>=X`` -> ``==X``).

Used by ``make test-lowest``: the package installed at the lowest versions it admits, so a floor that is lower than
an API the code uses fails a test instead of a user's run. Test tools (the ``dev`` extra) are not pinned.
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[1:]:  # e.g. hf remote
    reqs += [r for r in project["optional-dependencies"][extra] if not r.startswith("looptrace")]
for req in reqs:
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$", req)
    name, spec = m.group(1), m.group(3)
    floor = re.search(r">=\s*([0-9][^,;\s]*)", spec)
    if name != "torch" and floor:  # torch: the CPU build on disk (installed first)
        print(f"{name}=={floor.group(1)}")

"""The static import graph of looptrace: which ``looptrace.*`` modules (and which external packages) a file
imports, transitively, function-level imports included.

Used by tests/test_dvc_deps.py (dvc.yaml deps are exactly a stage's closure; offline stages import no
torch/model/capture code) and tests/test_layout.py (the module graph drawn in docs/DESIGN.md is true).

A module name maps to its file by the source layout pip installs (``looptrace`` -> ``pipeline/looptrace/``: import
path = file path), so the walk follows exactly what ``import looptrace.x`` loads. Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first: they
are part of the closure.

A registry's lazy entry (``looptrace.registry.Registry``: the string ``"looptrace.x.y:object"``, imported when the
entry is first used) is an import too: :meth:`ImportGraph.closure` follows every string literal that names one of the
tree's modules that way (:meth:`ImportGraph.references`), so a module a stage reaches only through a table (an
adapter kind) is in its closure, hence in its ``dvc.yaml`` deps. :meth:`ImportGraph.direct_imports` stays the import
statements (the module graph of docs/DESIGN.md).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: A lazy registry entry: ``package.module:object`` (dotted attribute allowed).
REFERENCE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


class ImportGraph:
    """The import graph of one source tree (this checkout by default; an old commit's tree for comparisons).

    Args:
        root: the tree's top directory.
        package_dirs: package name -> directory relative to ``root`` (default: ``looptrace`` under each
            ``where`` folder of ``root``'s pyproject.toml ``packages.find``).
    """

    def __init__(self, root: Path = REPO, package_dirs: dict[str, str] | None = None):
        self.root = root.resolve()
        if package_dirs is None:
            cfg = tomllib.loads((self.root / "pyproject.toml").read_text())
            (where,) = cfg["tool"]["setuptools"]["packages"]["find"]["where"]
            package_dirs = {"looptrace": f"{where}/looptrace"}
        self.package_dirs = {k: self.root / v for k, v in sorted(package_dirs.items(), key=lambda kv: -len(kv[0]))}
        self._direct: dict[Path, tuple[frozenset[str], frozenset[str]]] = {}
        self._refs: dict[Path, frozenset[str]] = {}

    def ours(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.package_dirs)

    def module_file(self, module: str) -> Path | None:
        """The file that ``import module`` executes (None: not one of the tree's modules, or an attribute)."""
        for pkg, d in self.package_dirs.items():
            if module == pkg or module.startswith(pkg + "."):
                rest = module[len(pkg) + 1:].split(".") if module != pkg else []
                base = d.joinpath(*rest)
                if rest and base.with_suffix(".py").is_file():
                    return base.with_suffix(".py")
                if (base / "__init__.py").is_file():
                    return base / "__init__.py"
                return None
        return None

    def module_name(self, path: Path) -> str | None:
        """Inverse of :meth:`module_file` (None for a file outside the packages)."""
        path = path.resolve()
        for pkg, d in self.package_dirs.items():
            try:
                r = path.relative_to(d.resolve())
            except ValueError:
                continue
            parts = list(r.with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join([pkg, *parts])
        return None

    def _absolute(self, node: ast.ImportFrom, importer: Path) -> str | None:
        if node.level == 0:
            return node.module
        own = self.module_name(importer)
        if own is None:
            return None
        pkg = own.split(".") if importer.name == "__init__.py" else own.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        return ".".join([*pkg, *([node.module] if node.module else [])])

    def direct_imports(self, path: Path) -> tuple[frozenset[str], frozenset[str]]:
        """(the tree's modules, external top-level packages) a file imports anywhere in its body."""
        if path in self._direct:
            return self._direct[path]
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = self._absolute(node, path)
                if mod is None or mod == "__future__":
                    continue
                names.add(mod)
                names.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
        ours, ext = set(), set()
        for n in names:
            if self.ours(n):
                parts = n.split(".")
                for i in range(1, len(parts) + 1):  # the module, and every package above it (their __init__ run)
                    if self.module_file(".".join(parts[:i])) is not None:
                        ours.add(".".join(parts[:i]))
            else:
                ext.add(n.split(".")[0])
        self._direct[path] = (frozenset(ours), frozenset(ext))
        return self._direct[path]

    def references(self, path: Path) -> frozenset[str]:
        """The tree's modules (and the packages above them) that string literals of ``path`` name as lazy registry
        entries ``"package.module:object"``."""
        if path in self._refs:
            return self._refs[path]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and REFERENCE.fullmatch(node.value):
                mod = node.value.split(":")[0]
                if self.ours(mod) and self.module_file(mod) is not None:
                    parts = mod.split(".")
                    out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                               if self.module_file(".".join(parts[:i])) is not None)
        self._refs[path] = frozenset(out)
        return self._refs[path]

    def closure(self, start: Path) -> tuple[set[Path], set[str], set[str]]:
        """Transitive closure from ``start`` (a stage script or a module file), lazy registry entries included.

        Returns:
            (files executed, ``start`` included; module names; external top-level packages).
        """
        files, modules, ext = {start.resolve()}, set(), set()
        todo = [start.resolve()]
        while todo:
            f = todo.pop()
            ours, other = self.direct_imports(f)
            ext |= other
            for m in ours | self.references(f):
                if m in modules:
                    continue
                modules.add(m)
                f = self.module_file(m).resolve()
                if f not in files:
                    files.add(f)
                    todo.append(f)
        return files, modules, ext

    def rel(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()


GRAPH = ImportGraph()
module_file, module_name, closure, rel = GRAPH.module_file, GRAPH.module_name, GRAPH.closure, GRAPH.rel

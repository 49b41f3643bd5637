"""The house rules of STYLE.md that a machine can check: imports point downward, no module takes part
in an import cycle (nor dodges one with an import inside a function), modules stay small, and
docs/how-it-works.md's tree draws every part."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"

# Layer of each top-level part: a module may import only parts of a lower or equal layer
# (equal: within its own part). models and telemetry know nothing of the others.
LAYERS = {
    "errors": 0, "atomic": 0, "file_lock": 0, "outdir": 0, "caches": 0, "models": 0, "options": 0, "command_parser": 0,
    "dependencies": 0, "public_names": 0,
    "telemetry": 1, "data": 1, "runtime": 1,
    "comm": 2,
    "data_parallel": 3, "model_split": 3,
    "train": 4,
    "job": 5, "measure": 5, "autopar": 6,
    "bench": 7, "verify": 7, "predict": 7, "sweep": 7,
    "cli": 8, "__main__": 9,
}
ISOLATED = {"models": {"errors", "atomic"}, "telemetry": {"errors", "atomic"}}


def _part(module_path: Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(module_path: Path):
    tree = ast.parse(module_path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phalanx"):
            yield node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("phalanx"):
                    yield alias.name


def test_imports_point_downward():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        part = _part(path)
        assert part in LAYERS, f"{path} belongs to no layer; add it to LAYERS"
        for module in _imports(path):
            pieces = module.split(".")
            if len(pieces) < 2:
                continue
            target = pieces[1]
            if target == part:
                continue
            if part in ISOLATED and target not in ISOLATED[part]:
                violations.append(f"{path.relative_to(PACKAGE)} imports {module} ({part} must stay independent)")
            elif LAYERS[target] > LAYERS[part]:
                violations.append(f"{path.relative_to(PACKAGE)} imports {module} (upward: {part} -> {target})")
    assert not violations, "\n".join(violations)


def test_modules_are_small_and_documented():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 320, f"{path} has {len(text.splitlines())} lines; split it"
        if text.strip():
            assert ast.get_docstring(ast.parse(text)), f"{path} lacks a purpose docstring"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, names: list[str], known: set[str]) -> list[str]:
    """The modules an import binds: `from pkg import sub` names the submodule, not pkg's __init__."""
    found = [f"{module}.{name}" for name in names if f"{module}.{name}" in known]
    if len(found) < len(names) and module in known:
        found.append(module)  # a name defined in (or re-exported by) `module` itself
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> modules it imports at module level, [(module, module it imports inside a function, line)])
    for the package at `root`. Module level includes imports under if/try at the top; a function's
    (or method's) body runs later, so an import there cannot take part in an import-time cycle."""
    paths = {_module_name(path, root): path for path in root.rglob("*.py")}
    known = set(paths)
    top: dict[str, set[str]] = {name: set() for name in paths}
    deferred: list[tuple[str, str, int]] = []
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        inside: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inside.update(id(child) for child in ast.walk(node) if child is not node)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = _resolve(node.module, [a.name for a in node.names], known)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in known]
            else:
                continue
            for target in targets:
                if target == name:
                    continue
                if id(node) in inside:
                    deferred.append((name, target, node.lineno))
                else:
                    top[name].add(target)
    return top, deferred


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path of module-level imports from `start` to `goal`, or None."""
    seen, stack = {start}, [[start]]
    while stack:
        path = stack.pop()
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == goal:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append(path + [nxt])
    return None


def cycle_violations(root: Path) -> list[str]:
    """Every import cycle among `root`'s modules, and every function-level import that dodges one."""
    top, deferred = import_graph(root)
    problems = []
    for module in sorted(top):
        loop = _reaches(top, module, module)
        if loop is not None and module == min(loop[:-1]):  # name each cycle once, from its first module
            problems.append("import cycle: " + " -> ".join(loop))
    for module, target, line in deferred:
        back = _reaches(top, target, module)
        if back is not None:
            problems.append(f"{module} imports {target} inside a function (line {line}) to dodge the cycle "
                            f"{' -> '.join([module] + back)}; move the shared part to a module both can import")
    return problems


def test_no_import_cycles_and_none_dodged():
    problems = cycle_violations(PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_cycle_check_finds_a_cycle_and_a_dodged_one(tmp_path):
    package = tmp_path / "pkg"
    (package / "train").mkdir(parents=True)
    (package / "__init__.py").write_text('"""Top."""\n')
    (package / "train" / "__init__.py").write_text('"""Part."""\nfrom pkg.train.loop import step\n')
    (package / "train" / "loop.py").write_text('"""Loop."""\nfrom pkg.train import config\n\ndef step():\n    pass\n')
    (package / "train" / "config.py").write_text('"""Config."""\nfrom pkg.train.loop import step\n')
    (package / "train" / "job.py").write_text(
        '"""Job."""\n\ndef run():\n    from pkg.train.split_job import worker\n    return worker()\n')
    (package / "train" / "split_job.py").write_text('"""Split job."""\nfrom pkg.train.job import run\n\ndef worker():\n    pass\n')
    (package / "train" / "lazy.py").write_text('"""A lazy import that closes no cycle."""\n\ndef f():\n    from pkg.train import config\n')
    problems = cycle_violations(package)
    assert problems == [
        "import cycle: pkg.train.config -> pkg.train.loop -> pkg.train.config",
        "pkg.train.job imports pkg.train.split_job inside a function (line 4) to dodge the cycle "
        "pkg.train.job -> pkg.train.split_job -> pkg.train.job; move the shared part to a module both can import",
    ], problems


def test_how_it_works_draws_every_part_and_example():
    # STYLE.md: a reader of docs/how-it-works.md's tree sees every pillar; the tree is drawn by hand,
    # so a new top-level module, sub-package or example has to be added there too.
    page = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    tree = page[page.index("```\nphalanx/\n"):]
    tree = tree[:tree.index("\n```", 4)]
    paths = [*PACKAGE.glob("*.py"), *PACKAGE.glob("*/"), *PACKAGE.glob("*/*/")]  # modules, packages, sub-packages
    parts = {path.relative_to(PACKAGE).as_posix() for path in paths
             if path.name not in ("__init__.py", "__main__.py", "__pycache__")}
    drawn = {part for part in parts if re.search(rf"(?<!\w){re.escape(part.rsplit('/', 1)[-1])}(?!\w)", tree)}
    assert parts - drawn == set(), f"docs/how-it-works.md's tree does not draw {sorted(parts - drawn)}"
    examples = tree[tree.index("\nexamples/"):]
    stems = {path.stem for path in (PACKAGE.parent / "examples").iterdir() if path.suffix in (".py", ".ipynb")}
    assert {stem for stem in stems if stem not in examples} == set(), "examples/ the tree does not name"

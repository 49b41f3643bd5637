"""The house rules of STYLE.md that a machine can check: imports point downward, modules stay small."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"

# Layer of each top-level part: a module may import only parts of a lower or equal layer
# (equal: within its own part). models and telemetry know nothing of the others.
LAYERS = {
    "errors": 0, "atomic": 0, "outdir": 0, "models": 0, "telemetry": 1,
    "world": 1, "devices": 1, "data": 1,
    "comm": 2, "launch": 3, "lifeline": 2, "supervise": 2, "binding": 1, "script": 4, "parallel": 3, "train": 4, "bench": 5, "verify": 5, "predict": 6, "sweep": 5,
    "cli": 7, "__main__": 8,
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

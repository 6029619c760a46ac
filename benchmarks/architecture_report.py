"""The package's shape in numbers, read from the source: modules and lines per package, the longest functions,
imports inside functions, and where a few concepts are spelled out (comparisons with a `Strategy` member, writes of
a run's status). `python benchmarks/architecture_report.py [SRC]` (default: this checkout's `src/`)."""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path


def modules(src: Path) -> dict[str, Path]:
    return {str(p.relative_to(src)): p for p in sorted(src.rglob("*.py"))}


def package(rel: str) -> str:
    parts = Path(rel).parts
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0] + "/ (top)"


def functions(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.name, node.end_lineno - node.lineno + 1))
    return found


def imports_inside_functions(tree: ast.AST) -> int:
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return len(inner)


def main(src: Path) -> None:
    per_package: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    longest: list[tuple[int, str]] = []
    inner_imports = strategy_lines = status_writes = 0
    strategy_modules, status_modules = set(), set()
    for rel, path in modules(src).items():
        text = path.read_text()
        tree = ast.parse(text)
        pkg = per_package[package(rel)]
        pkg[0] += 1
        pkg[1] += len(text.splitlines())
        longest += [(n, f"{rel}:{name}") for name, n in functions(tree)]
        inner_imports += imports_inside_functions(tree)
        for line in text.splitlines():
            if re.search(r"Strategy\.(single_device|ddp|fsdp|model_parallel)\b", line) and not line.lstrip().startswith(
                "#"
            ):
                strategy_lines += 1
                strategy_modules.add(rel)
            if re.search(r"\bwrite_status\(", line) and "def write_status" not in line:
                status_writes += 1
                status_modules.add(rel)
    print("| package | modules | lines |\n|---|---|---|")
    for name, (count, lines) in sorted(per_package.items()):
        print(f"| {name} | {count} | {lines:,} |")
    print("\nlongest functions (lines):")
    for n, where in sorted(longest, reverse=True)[:10]:
        print(f"  {n:4d}  {where}")
    print(f"\nimports inside functions: {inner_imports}")
    print(f"lines naming a Strategy member: {strategy_lines} in {len(strategy_modules)} modules")
    print(f"status writes (write_status calls): {status_writes} in {len(status_modules)} modules")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src")

"""The package's layers, checked from the source: every import of an `exp` module points down (or sideways within a
layer), no import circle, and an import inside a function says why on its line or the one above.

Layers, bottom to top (docs/architecture.md): core, data, model, hardware, run, training, then the user commands at
the top of `exp` (train, evaluate, generate, merge, preview, doctor, report, bench)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "exp"
LAYERS = ["core", "data", "model", "hardware", "run", "training"]
COMMANDS = {"train", "evaluate", "generate", "merge", "preview", "doctor", "report", "bench"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("exp", *parts))] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    """A layer package's modules sit in its layer; a command (a module at the top of exp, or a package there with
    its submodules: exp.bench.cli is exp.bench) and the package itself sit above every layer."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported exp module, line, inside a function) for every import of an exp module in `path`."""
    tree = ast.parse(path.read_text())
    inner_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner_nodes.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "exp":
            names = [node.module]
            # `from exp.run import dirs` names a module too
            names += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "exp"]
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES and not name.endswith(tuple(f".{layer}" for layer in LAYERS)) and name != "exp":
                found.append((name, node.lineno, id(node) in inner_nodes))
    return found


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_module_sits_in_a_layer_or_is_a_command():
    """Every module is in a layer package, or is a user command: a module at the top of exp, or a module of a
    command's package (exp.bench.*)."""
    stray = [m for m in MODULES if m != "exp" and m.split(".")[1] not in COMMANDS | set(LAYERS)]
    assert not stray, f"modules that are neither in a layer nor part of a user command: {stray}"


def test_imports_point_down():
    upward = [
        f"{m} (line {line}) imports {target}"
        for m, imports in GRAPH.items()
        for target, line, _ in imports
        if _layer(target) > _layer(m)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circle():
    edges = {m: {t for t, _, _ in imports if t != m} for m, imports in GRAPH.items()}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def _says_why(lines: list[str], line: int) -> bool:
    """A comment on the import's line, or above the block of imports it belongs to."""
    i = line - 1
    if "#" in lines[i]:
        return True
    while (
        i > 0
        and lines[i - 1].strip().startswith(("from ", "import ", ")"))
        or (i > 0 and lines[i - 1].startswith(" " * 8) and lines[i - 1].strip().endswith(","))
    ):
        i -= 1
        if "#" in lines[i]:
            return True
    return i > 0 and lines[i - 1].strip().startswith("#")


def test_imports_inside_functions_say_why():
    silent = []
    for m, imports in GRAPH.items():
        lines = MODULES[m].read_text().splitlines()
        for target, line, inner in imports:
            if inner and not _says_why(lines, line):
                silent.append(f"{MODULES[m].relative_to(SRC.parent)}:{line} imports {target}")
    assert not silent, "imports inside a function without a comment saying why:\n" + "\n".join(silent)


@pytest.mark.parametrize(
    "module",
    [
        "exp.core.config",
        "exp.core.cli",
        "exp.hardware.memory",
        "exp.hardware.preflight",
        "exp.run.compose",
        "exp.doctor",
    ],
)
def test_torch_free_modules_import_without_torch(module):
    """The config path and the memory arithmetic stay cheap: a fresh interpreter imports them without torch."""
    import subprocess
    import sys

    code = f"import sys, {module}; heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]; print(heavy); sys.exit(bool(heavy))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{module} imports {proc.stdout.strip()} {proc.stderr[-500:]}"


def test_the_schema_defaults_are_the_default_run():
    """`TrainConfig()` is what `python -m exp.train` with no arguments composes: one definition of the default run."""
    from exp.core.config import TrainConfig
    from exp.run.compose import compose_config, config_dict

    assert config_dict(TrainConfig()) == config_dict(compose_config([]))


def test_option_files_hold_only_what_differs_from_the_schema():
    """A value an option file repeats from the schema would go stale the day the schema changes."""
    import dataclasses

    import yaml
    from omegaconf import OmegaConf

    from exp.core.config import TrainConfig
    from exp.run.compose import CONF_DIR

    repeated = []
    for f in dataclasses.fields(TrainConfig):
        if f.default_factory is dataclasses.MISSING or not (CONF_DIR / f.name).is_dir():
            continue
        default = OmegaConf.to_container(OmegaConf.structured(f.default_factory()), enum_to_str=True)
        for option in sorted((CONF_DIR / f.name).glob("*.yaml")):
            values = yaml.safe_load(option.read_text()) or {}
            # A value that overrides the option it extends (its `defaults` list) differs from what it would get.
            inherited = {
                k
                for parent in values.get("defaults", [])
                if isinstance(parent, str) and parent != "_self_"
                for k in yaml.safe_load((CONF_DIR / f.name / f"{parent}.yaml").read_text()) or {}
            }
            repeated += [
                f"{option.relative_to(CONF_DIR)}: {k}: {v!r}"
                for k, v in values.items()
                if k != "defaults" and k not in inherited and k in default and default[k] == v
            ]
    assert not repeated, "option values equal to the schema's defaults:\n" + "\n".join(repeated)

"""The package's layers, checked from the source: every import of an `exp` module points down (or sideways within a
layer), no import circle, and an import inside a function says why on its line or the one above. Hydra's plugins
(`src/hydra_plugins/`) sit above the user commands. docs/architecture.md names every module, in its package's row
of the layer picture, and the layers' numbers agree between this file, the doc and each package's docstring.

Layers, bottom to top (docs/architecture.md): core, data, model, hardware, run, training, study, then the user commands
at the top of `exp` (train, evaluate, generate, merge, preview, doctor, report, bench)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "exp"
PLUGINS = ROOT / "src" / "hydra_plugins"  # Hydra's plugins: above the user commands, nothing in exp imports them
LAYERS = ["core", "data", "model", "hardware", "run", "training", "study"]
COMMANDS = {"train", "evaluate", "generate", "merge", "preview", "doctor", "report", "bench"}
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    found = {}
    for top, name in ((SRC, "exp"), (PLUGINS, "hydra_plugins")):
        for path in top.rglob("*.py"):
            parts = path.relative_to(top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    """A layer package's modules sit in its layer; a command (a module at the top of exp, or a package there with
    its submodules: exp.bench.cli is exp.bench) and the package itself sit above every layer, and Hydra's plugins
    above the commands."""
    if module.split(".")[0] == "hydra_plugins":
        return len(LAYERS) + 1
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
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("exp", "hydra_plugins"):
            names = [node.module]
            # `from exp.run import dirs` names a module too
            names += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] in ("exp", "hydra_plugins")]
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if (
                name in MODULES
                and not name.endswith(tuple(f".{layer}" for layer in LAYERS))
                and name not in ("exp", "hydra_plugins")
            ):
                found.append((name, node.lineno, id(node) in inner_nodes))
    return found


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_module_sits_in_a_layer_or_is_a_command():
    """Every module is in a layer package, or is a user command: a module at the top of exp, or a module of a
    command's package (exp.bench.*)."""
    stray = [m for m in MODULES if m.startswith("exp.") and m.split(".")[1] not in COMMANDS | set(LAYERS)]
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


def _picture_rows() -> dict[str, set[str]]:
    """The words of each row of docs/architecture.md's layer picture, by the row's name (a layer, after its number,
    or "user commands"): a row begins at a line whose first words name it and runs to the next rule line."""
    picture = ARCHITECTURE_DOC.read_text().split("```")[1]
    names = [*LAYERS, "user commands"]
    rows: dict[str, set[str]] = {}
    current = None
    for line in picture.splitlines():
        if line.strip().startswith("─"):
            current = None
            continue
        head = line[:18].strip().lstrip("0123456789 ")
        if head in names:
            current = head
        if current is not None:
            rows.setdefault(current, set()).update(re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", line[18:]))
    return rows


def _command_picture(command: str) -> set[str]:
    """The modules a command package's own picture names: the first word of each line of the first code block after
    the heading that names the package (`exp.bench`)."""
    text = ARCHITECTURE_DOC.read_text()
    heading = re.search(rf"^#+ .*`exp\.{command}`.*$", text, flags=re.M)
    if heading is None:
        return set()
    block = text[heading.end() :].split("```")[1]
    return {line.split()[0] for line in block.splitlines() if line.strip()}


def test_the_architecture_doc_names_every_module():
    rows = _picture_rows()
    missing = []
    for m in MODULES:
        parts = m.split(".")
        if parts[0] == "hydra_plugins":
            named = m in ARCHITECTURE_DOC.read_text() or len(parts) < 3  # named beside the picture
        elif len(parts) == 1 or (len(parts) == 2 and parts[1] in LAYERS):
            named = True  # a package: its row is the layer
        elif len(parts) == 2 or parts[1] not in LAYERS:
            named = f"exp.{parts[1]}" in rows.get("user commands", set()) and (
                len(parts) == 2 or parts[-1] in _command_picture(parts[1])
            )
        else:
            named = parts[-1] in rows.get(parts[1], set())
        if not named:
            missing.append(m)
    assert not missing, f"modules docs/architecture.md's layer picture does not name: {missing}"


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def test_the_layers_numbers_agree():
    """Each layer package's docstring starts with its index in LAYERS ("Layer 0" is core), the picture's rows carry
    the same numbers, and the doc counts the layers."""
    wrong = []
    for index, layer in enumerate(LAYERS):
        doc = ast.get_docstring(ast.parse((SRC / layer / "__init__.py").read_text())) or ""
        if not doc.startswith(f"Layer {index},"):
            wrong.append(f"exp.{layer}: {doc[:20]!r} (expected 'Layer {index},')")
    assert not wrong, "layer numbers that disagree with LAYERS:\n" + "\n".join(wrong)
    text = ARCHITECTURE_DOC.read_text()
    picture = text.split("```")[1]
    numbered = dict(re.findall(r"^ ?(\d+) (\w+)", picture, flags=re.M))
    assert numbered == {str(i): layer for i, layer in enumerate(LAYERS)}
    assert f"is {NUMBER_WORDS[len(LAYERS)]} layer packages" in text


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
        "exp.core.strategies",
        "exp.core.cli",
        "exp.model.families",
        "exp.hardware.memory",
        "exp.hardware.preflight",
        "exp.run.compose",
        "exp.study.scheduler",
        "exp.doctor",
    ],
)
def test_torch_free_modules_import_without_torch(module):
    """The config path and the memory arithmetic stay cheap, and the `gpus` launcher's process, which only starts
    job processes, never loads torch: a fresh interpreter imports them without it."""
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
    """A value an option file repeats from the schema (the node it is merged onto) would go stale the day the
    schema changes."""
    import dataclasses

    import yaml
    from omegaconf import OmegaConf

    from exp.core.config import TrainConfig, schema_node
    from exp.run.compose import CONF_DIR

    repeated = []
    for f in dataclasses.fields(TrainConfig):
        if f.default_factory is dataclasses.MISSING or not (CONF_DIR / f.name).is_dir():
            continue
        default = OmegaConf.to_container(OmegaConf.structured(getattr(schema_node(), f.name)), enum_to_str=True)
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

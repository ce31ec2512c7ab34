"""osfarm's imports point one way: read every module's imports from its source (AST, nothing is
imported) and fail on an upward import, an import cycle, or a function-local import that is not
on the allow-list.

The layers, lowest first (a module may import its own layer and any lower one)::

    desktop (runs inside the box) -> images -> providers -> tasks, evaluators -> farm -> client
      -> env -> agents, policy, stream -> runner -> trainer -> dashboard -> osfarm.cli (the command)

``images`` (how desktop images are built) sits under ``providers`` because the libvirt provider
finds its disk with it. ``tasks``/``evaluators`` (the OSWorld task lifecycle, spoken to a guest
server) sit under the farm because the farm's reset/evaluate routes run that same lifecycle;
they know a desktop only by its guest endpoint. The ``client`` sits on the farm because it speaks
the farm's wire models (``farm.schemas``). ``stream`` (trajectory records and sinks) imports
nothing of osfarm; it sits beside ``agents`` and ``policy``, where the runner and the trainer use
it. The ``dashboard`` (web UI) sits on top, under the command only: it reads the farm's pool and
guest links (live view), the stream's records and the runner's results layout (run pages), so
nothing below imports it; the farm serves it because whoever builds the farm app hands its
routers in (``farm.api.create_app(..., ui=dashboard.app.farm_ui(...))``: ``osfarm serve``). A
subpackage's own ``cli.py`` belongs to its package's layer.

What counts:

* every ``import``/``from ... import`` anywhere in a module: at module level, inside functions,
  classes and ``if`` blocks. Imports under ``if TYPE_CHECKING:`` count for the direction (a type
  seen from below is still a dependency) but not for cycles (they never run).
* a cycle is any strongly connected set of modules (between or inside subpackages), counting
  function-local imports, which only hide a cycle.
* a function-local import must be of a heavy or optional third-party dependency
  (``LAZY_THIRD_PARTY``) or of an osfarm module in ``LAZY_OSFARM`` (each with its reason);
  everything else goes at the top of the module, where a reader sees it. The one exemption:
  command modules (``osfarm.cli`` and each ``osfarm.<package>.cli``) load a command's
  implementation when the command runs, so that ``osfarm --help`` starts in about a second
  instead of four (the farm app alone takes ~3 s to import).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import osfarm

ROOT = Path(osfarm.__file__).resolve().parent

# Lowest first; one entry per layer, modules named by dotted prefix.
LAYERS: list[tuple[str, ...]] = [
    ("osfarm.desktop",),
    ("osfarm.images",),
    ("osfarm.providers",),
    ("osfarm.tasks", "osfarm.evaluators"),
    ("osfarm.farm",),
    ("osfarm.client",),
    ("osfarm.env",),
    ("osfarm.agents", "osfarm.policy", "osfarm.stream"),
    ("osfarm.runner",),
    ("osfarm.trainer",),
    ("osfarm.dashboard",),
    ("osfarm.cli",),
]

# Layer-neutral modules: any layer may import them, and they import only each other.
NEUTRAL = {
    "osfarm": "the package root: its version string",
    "osfarm.config": "settings and the YAML-with-line-numbers loader; read by the farm, the providers and the trainer",
    "osfarm.http": "bearer auth and error-reply parsing shared by the guest server, the farm and the clients",
}

# Third-party packages a function may import lazily: heavy (seconds or hundreds of MB to load)
# or optional (an extra that may not be installed, or a system binding).
LAZY_THIRD_PARTY = {
    "torch": "heavy (seconds to import); only the policy server and the learner; optional extra",
    "transformers": "heavy; only the policy server and the learner; optional extra",
    "peft": "heavy; only LoRA training; optional extra",
    "safetensors": "torch's weight files, next to torch; optional extra",
    "tokenizers": "only to build the tiny local policy's tokenizer; comes with transformers",
    "matplotlib": "heavy; only the trainer's plots; optional extra",
    "docker": "optional extra; only the docker provider and image builds",
    "celery": "heavy; only the Celery executor and worker; optional extra",
    "redis": "optional extra; only with a Redis stream or broker",
    "libvirt": "system binding (python3-libvirt); only on libvirt hosts",
    "libvirt_qemu": "system binding (python3-libvirt); only on libvirt hosts",
    "gi": "system binding (AT-SPI over GObject); only inside a desktop with an accessibility bus",
    "pandas": "~0.2 s to import; only the table getters need it",
    "numpy": ("the session launcher loads it with OpenBLAS single-threaded (an environment variable read at "
              "load), before the desktop's processes start, so that none of them inherits the setting"),
    "wandb": "optional (not in any extra); only when a W&B project is configured for training",
    "easyocr": "optional extra (ocr); seconds to import (torch); only compare_image_text",
    "easyocr_en_models": "optional extra (ocr): EasyOCR's weights; only compare_image_text",
}

# osfarm modules a function may import lazily, each because importing it at module level would
# load one of LAZY_THIRD_PARTY (or start something) for callers that never use it.
LAZY_OSFARM: dict[str, str] = {
    "osfarm.providers.sandbox": ("make_provider: each provider's module only when chosen (psutil, namespace and "
                                 "cgroup checks)"),
    "osfarm.providers.docker": "make_provider: the docker provider only when chosen",
    "osfarm.providers.libvirt": "make_provider: the libvirt provider (and its libvirt binding) only when chosen",
    "osfarm.stream.redis_stream": "imports redis",
    "osfarm.runner.executors.celery_app": "imports celery",
    "osfarm.runner.executors.celery_exec": "imports celery and redis",
    "osfarm.runner.executors.worker_task": "imports celery and redis",
    "osfarm.desktop.guest_server": "the session launcher imports the server stack (fastapi, uvicorn, numpy, "
    "PIL, Xlib: 0.2-0.3 s) while Xvfb starts (~0.15 s), not before: a reset is kill + start",
    "osfarm.http.download": ("the guest's /setup/download_file imports it on its first call: it imports httpx "
                             "(and httpx its command line's click, rich, pygments: ~70 ms of every cold start)"),
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported osfarm module (or top-level third-party name)
    line: int
    local: bool  # inside a function or class body
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "assets" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, source: str, is_pkg: bool, modules: dict[str, Path]) -> Iterator[Import]:
    tree = ast.parse(source, name)

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
            return
        mod = resolve(node)
        for alias in node.names:
            sub = f"{mod}.{alias.name}"
            yield sub if sub in modules else mod

    def walk(node: ast.AST, local: bool, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    yield Import(name, t, child.lineno, local, type_only)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                yield from walk(child, True, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), local, type_only)
            else:
                yield from walk(child, local, type_only)

    yield from walk(tree, False, False)


def graph() -> tuple[dict[str, Path], list[Import]]:
    modules = all_modules()
    found = [imp for name, path in modules.items()
             for imp in imports_of(name, path.read_text(), path.name == "__init__.py", modules)]
    return modules, found


def owner(module: str, modules: dict[str, Path]) -> str:
    """The osfarm module an import lands in (``osfarm.x.y`` names a module or a package)."""
    parts = module.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """Index in LAYERS; None for a neutral module."""
    for name in NEUTRAL:
        if module == name or (name != "osfarm" and module.startswith(name + ".")):
            return None
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS or NEUTRAL in tests/test_layers.py")


def layer_name(i: int | None) -> str:
    return "neutral" if i is None else "/".join(p.removeprefix("osfarm.") for p in LAYERS[i])


def is_command_module(module: str) -> bool:
    return module == "osfarm.cli" or (module.startswith("osfarm.") and module.endswith(".cli"))


def internal(imp: Import) -> bool:
    return imp.target == "osfarm" or imp.target.startswith("osfarm.")


# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> tuple[dict[str, Path], list[Import]]:
    return graph()


def where(imp: Import, modules: dict[str, Path]) -> str:
    return f"{modules[imp.source].relative_to(ROOT.parent)}:{imp.line}"


def test_every_module_has_a_layer(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, _ = imports
    for name in modules:
        layer_of(name)


def test_imports_point_down(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, found = imports
    bad = []
    for imp in found:
        if not internal(imp):
            continue
        target = owner(imp.target, modules)
        src, dst = layer_of(imp.source), layer_of(target)
        if dst is None:
            continue  # neutral modules are everyone's
        if src is None or dst > src:
            bad.append(f"{where(imp, modules)}: {imp.source} ({layer_name(src)}) imports {target} ({layer_name(dst)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_the_farm_imports_nothing_of_runner_agents_trainer(imports: tuple[dict[str, Path], list[Import]]) -> None:
    # Implied by the layers; spelt out because it is the rule that matters most (DESIGN.md).
    modules, found = imports
    banned = ("osfarm.runner", "osfarm.agents", "osfarm.trainer", "osfarm.policy", "osfarm.env")
    bad = [f"{where(i, modules)}: {i.target}" for i in found
           if i.source.startswith("osfarm.farm") and i.target.startswith(banned)]
    assert not bad, "\n".join(bad)


def _cycles(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def strong(v: str) -> None:  # Tarjan, iterative enough for a few hundred modules
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, found = imports
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for imp in found:
        if not internal(imp) or imp.type_only:
            continue
        target = owner(imp.target, modules)
        if target == imp.source:
            continue
        edges.setdefault(imp.source, set()).add(target)
        lines.setdefault((imp.source, target), where(imp, modules) + (" (function-local)" if imp.local else ""))
    cycles = _cycles(set(modules), edges)
    report = []
    for comp in cycles:
        members = set(comp)
        report.append("cycle: " + ", ".join(comp))
        report += [f"    {lines[(a, b)]}: {a} -> {b}" for a in comp for b in sorted(edges.get(a, ())) if b in members]
    assert not cycles, "\n".join(report)


def test_function_local_imports_are_on_the_allow_list(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, found = imports
    bad = []
    for imp in found:
        if not imp.local or imp.type_only or is_command_module(imp.source):
            continue
        if internal(imp):
            if owner(imp.target, modules) in LAZY_OSFARM:
                continue
        elif imp.target.split(".")[0] in LAZY_THIRD_PARTY:
            continue
        bad.append(f"{where(imp, modules)}: {imp.target}")
    assert not bad, ("function-local imports of neither a heavy optional dependency nor an allowed "
                     "osfarm module (move them to the top, or add them to the allow-list with a reason):\n"
                     + "\n".join(sorted(bad)))


def test_the_allow_lists_name_real_modules(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, _ = imports
    assert [m for m in LAZY_OSFARM if m not in modules] == []
    assert [m for m in NEUTRAL if m not in modules] == []


def test_the_checker_sees_what_it_must() -> None:
    # The walker on a made-up module: a nested function-local import, a relative import, a
    # TYPE_CHECKING import; so a silent walker cannot pass the tests above.
    src = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import pool\n"
        "if TYPE_CHECKING:\n"
        "    from osfarm.client import Farm\n"
        "class A:\n"
        "    def f(self):\n"
        "        if True:\n"
        "            import osfarm.runner.run\n"
    )
    modules = all_modules()
    got = {(i.target, i.local, i.type_only) for i in imports_of("osfarm.farm.probe", src, False, modules)}
    assert ("osfarm.farm.pool", False, False) in got
    assert ("osfarm.client", False, True) in got
    assert ("osfarm.runner.run", True, False) in got
    assert _cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layer_of("osfarm.farm.pool") < layer_of("osfarm.client")  # type: ignore[operator]

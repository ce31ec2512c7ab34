"""osfarm's imports point one way: read every module's imports from its source (AST, nothing is
imported) and fail on an upward import, an import between two packages of one layer against its
documented direction, an import cycle, or a function-local import that is not on the allow-list.

The layers, lowest first (a module may import its own layer and any lower one)::

    schema (the wire models) -> desktop (runs inside the box) -> images -> providers
      -> tasks, evaluators -> farm -> client -> env -> agents, policy, stream, osworld -> runner -> trainer
      -> dashboard -> testing -> osfarm.cli (the command)

``schema`` is the one typed wire layer: actions, observations, the guest's step models, leases,
pool status, the farm's service answers and the ``osfarm.episode/1`` record. Everything that
speaks to a desktop, a farm or a record store reads and writes these models, so it sits at the
bottom and imports nothing of osfarm but the error base.

``images`` (how desktop images are built) sits under ``providers`` because the libvirt provider
finds its disk with it. ``tasks``/``evaluators`` (the OSWorld task lifecycle, spoken to a guest
server) sit under the farm because the farm's reset/evaluate routes run that same lifecycle;
they know a desktop only by its guest endpoint. They are one layer with a direction inside it
(``ACROSS``): the task lifecycle runs the evaluators, never the other way; what both need (the
guest's error, confined host paths) is layer-neutral. ``desktop`` has a direction inside it too,
one subpackage per concept: ``x11`` (the X display) and ``box`` (the box and the agent's world),
which import none of each other, under ``session`` (the desktop session and the routes' shared
Desktop), under ``warm`` (fingerprint, warm reset), under ``guest`` (the guest HTTP server),
under ``launch`` (the launcher and the box template that start it all). The ``client`` sits on the farm (it raises the
farm's errors and speaks its routes; the models are ``schema``'s). ``stream`` (trajectory record sinks)
imports nothing of osfarm but ``schema`` and the error base; it sits beside ``agents`` and ``policy``, where the
runner and the trainer use it, and none of the three imports another; ``osworld`` (OSWorld's
DesktopEnv over the env) sits beside them too and imports none of them. The ``dashboard`` (web UI) sits on top,
under the command only: it reads the farm's pool and guest links (live view), the stream's records
and the runner's results layout (run pages), so nothing below imports it; the farm serves it
because whoever builds the farm app hands its routers in (``farm.api.create_app(...,
ui=dashboard.app.farm_ui(...))``: ``osfarm serve``). A subpackage's own ``cli.py`` belongs to its
package's layer.

``testing`` (``osfarm.testing``, installed like ``numpy.testing``: the helpers osfarm's tests,
``bench/`` and users' tests share, the one way to start a farm among them) sits over everything
it starts and drives, under the command; nothing else of osfarm imports it.

``bench/`` sits above all of it: a bench script may import any of osfarm (its helpers come from
``osfarm.testing``) and the other bench scripts, never a module of tests/; nothing in osfarm
imports a bench script or a test helper.

What counts:

* every ``import``/``from ... import`` anywhere in a module: at module level, inside functions,
  classes and ``if`` blocks, and under ``if TYPE_CHECKING:``, for the direction and for cycles
  alike (a type seen from below is still a dependency, and two modules that name each other's
  types cannot be read, moved or tested one without the other).
* a cycle is any strongly connected set of modules (between or inside subpackages, osfarm's and
  bench's), counting function-local imports, which only hide a cycle.
* a function-local import must be of a heavy or optional third-party dependency
  (``LAZY_THIRD_PARTY``) or of an osfarm module in ``LAZY_OSFARM`` (each with its reason);
  everything else goes at the top of the module, where a reader sees it. The one exemption:
  command modules (the ``osfarm.cli`` package and each ``osfarm.<package>.cli``) load a command's
  implementation when the command runs, so that ``osfarm --help`` starts in about a second
  instead of four (the farm app alone takes ~3 s to import). Bench scripts are not held to it.

Each check is a function of a module table and its imports (``graph(root)``), so the tests at the
bottom run the same functions on small made-up packages and prove they catch what they must.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import osfarm

ROOT = Path(osfarm.__file__).resolve().parent
REPO = ROOT.parent
BENCH = REPO / "bench"
TESTS = REPO / "tests"

# Lowest first; one entry per layer, modules named by dotted prefix.
LAYERS: list[tuple[str, ...]] = [
    ("osfarm.schema",),
    # desktop by concept, lowest first (ACROSS holds its direction); the package itself (its
    # __init__ and assets) last.
    ("osfarm.desktop.x11", "osfarm.desktop.box", "osfarm.desktop.session", "osfarm.desktop.warm",
     "osfarm.desktop.guest", "osfarm.desktop.launch", "osfarm.desktop"),
    ("osfarm.images",),
    ("osfarm.providers",),
    ("osfarm.tasks", "osfarm.evaluators"),
    ("osfarm.farm",),
    ("osfarm.client",),
    ("osfarm.env",),
    ("osfarm.agents", "osfarm.policy", "osfarm.stream", "osfarm.osworld"),
    ("osfarm.runner",),
    ("osfarm.trainer",),
    ("osfarm.dashboard",),
    ("osfarm.testing",),
    ("osfarm.cli",),
]

# Layer-neutral modules: any layer may import them, and they import only each other.
NEUTRAL = {
    "osfarm": "the package root: its version string",
    "osfarm.config": "settings and the YAML-with-line-numbers loader; read by the farm, the providers and the trainer",
    "osfarm.http": ("bearer auth and error-reply parsing shared by the guest server, the farm and the clients; "
                    "GuestError, which the task lifecycle's guest client raises and the evaluators catch"),
    "osfarm.host_paths": "task-given host paths confined to a folder; the task lifecycle and the evaluators use it",
    "osfarm.host_kvm": "whether KVM can run our VMs: the libvirt provider's accelerator, the settings' default desktop",
    "osfarm.errors": ("the exception hierarchy: OsfarmError, and the InfraError / EpisodeTimeout branches the runner "
                      "tells episodes' ends apart by; imports nothing of osfarm"),
}

# Inside a layer of several packages: the imports allowed from one package to another (importer,
# imported), each with its reason. Any other import between two packages of one layer is refused;
# a new one is a decision about the design, made here, and ACROSS itself must have no cycle (it is a
# direction). Today: tasks -> evaluators; desktop's subpackages one way (below); agents,
# policy and stream import none of each other (stream imports nothing of osfarm but schema and the error base).
ACROSS: dict[tuple[str, str], str] = {
    ("osfarm.tasks", "osfarm.evaluators"): (
        "the task lifecycle runs the evaluators (tasks.lifecycle's evaluate; tasks.coverage lists the getters and "
        "metrics a suite needs); the getters reach the desktop through the EvalEnv they are handed"),
    # desktop: x11, box -> session -> warm -> guest -> launch (x11 and box import none of each other)
    ("osfarm.desktop.session", "osfarm.desktop.x11"): (
        "the session starts its Xvfb; the routes' Desktop (session.guest_state) holds the capture, input, windows "
        "and recorder"),
    ("osfarm.desktop.session", "osfarm.desktop.box"): (
        "the session runs the agent's apps and buses in the agent's world and reaps its process tree; the Desktop "
        "holds the agent's file and code helpers"),
    ("osfarm.desktop.warm", "osfarm.desktop.x11"): "the fingerprint and the X reset read and put back the X state",
    ("osfarm.desktop.warm", "osfarm.desktop.box"): "the kill rounds end the agent's processes in the process tree",
    ("osfarm.desktop.warm", "osfarm.desktop.session"): (
        "a warm reset works on the routes' Desktop; the fingerprint knows GNOME's on-demand processes"),
    ("osfarm.desktop.guest", "osfarm.desktop.x11"): "the routes capture, record, list windows, set the wallpaper",
    ("osfarm.desktop.guest", "osfarm.desktop.box"): "the routes' file and command work is done as the agent",
    ("osfarm.desktop.guest", "osfarm.desktop.session"): "the routes share the session's Desktop and read its a11y tree",
    ("osfarm.desktop.guest", "osfarm.desktop.warm"): "the baseline, fingerprint and warm reset routes",
    ("osfarm.desktop.launch", "osfarm.desktop.x11"): "the launcher reports the X display's errors",
    ("osfarm.desktop.launch", "osfarm.desktop.box"): "the box template runs the box init; the launcher is a subreaper",
    ("osfarm.desktop.launch", "osfarm.desktop.session"): "the launcher starts the session",
    ("osfarm.desktop.launch", "osfarm.desktop.guest"): "the launcher serves the guest app",
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
    "osfarm.desktop.guest.guest_server": "the session launcher imports the server stack (fastapi, uvicorn, numpy, "
    "PIL, Xlib: 0.2-0.3 s) while Xvfb starts (~0.15 s), not before: a reset is kill + start",
    "osfarm.http.download": ("the guest's /setup/download_file imports it on its first call: it imports httpx "
                             "(and httpx its command line's click, rich, pygments: ~70 ms of every cold start)"),
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (osfarm's, bench's, a test helper's) or top-level third-party name
    line: int
    local: bool  # inside a function or class body
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path, root: Path) -> str:
    """``path``'s dotted name in the package whose folder is ``root`` (``pkg/a/b.py`` -> ``pkg.a.b``)."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "assets" not in p.parts}


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


def graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Import]]:
    """The modules of the package at ``root`` and every import they make."""
    modules = all_modules(root)
    found = [imp for name, path in modules.items()
             for imp in imports_of(name, path.read_text(), path.name == "__init__.py", modules)]
    return modules, found


def helper_names(tests: Path = TESTS) -> set[str]:
    """The names a script with tests/ (or one of its folders) on sys.path imports a test helper by."""
    return {p.stem for p in tests.rglob("*.py")
            if not p.name.startswith("test_") and p.name != "conftest.py" and "__pycache__" not in p.parts}


def bench_graph(bench: Path = BENCH, helpers: set[str] | None = None) -> tuple[dict[str, Path], list[Import]]:
    """The bench scripts (``bench.<script>``) and their imports. A script imports another by its
    bare name (bench/ is on sys.path): ``percentiles`` is ``bench.percentiles``; a test helper's bare
    name becomes ``tests:<name>``."""
    helpers = helper_names() if helpers is None else helpers
    modules = {f"bench.{p.stem}": p for p in sorted(bench.glob("*.py"))}
    found = []
    for name, path in modules.items():
        for imp in imports_of(name, path.read_text(), False, modules):
            top = imp.target.split(".")[0]
            if f"bench.{top}" in modules:
                imp = Import(imp.source, f"bench.{top}", imp.line, imp.local, imp.type_only)
            elif top in helpers:
                imp = Import(imp.source, f"tests:{top}", imp.line, imp.local, imp.type_only)
            found.append(imp)
    return modules, found


def owner(module: str, modules: dict[str, Path]) -> str:
    """The module an import lands in (``osfarm.x.y`` names a module or a package)."""
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


def package_of(module: str) -> str | None:
    """The LAYERS entry ``module`` is in (``osfarm.tasks.setup`` -> ``osfarm.tasks``); None if neutral."""
    i = layer_of(module)
    if i is None:
        return None
    return next(p for p in LAYERS[i] if module == p or module.startswith(p + "."))


def layer_name(i: int | None) -> str:
    return "neutral" if i is None else "/".join(p.removeprefix("osfarm.") for p in LAYERS[i])


def is_command_module(module: str) -> bool:
    return module.split(".")[:2] == ["osfarm", "cli"] or (module.startswith("osfarm.") and module.endswith(".cli"))


def internal(imp: Import) -> bool:
    return imp.target == "osfarm" or imp.target.startswith("osfarm.")


def where(imp: Import, modules: dict[str, Path]) -> str:
    path = modules[imp.source]
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return f"{shown}:{imp.line}" + (" (TYPE_CHECKING)" if imp.type_only else "")


# -- the checks: each returns what it found wrong -------------------------------------------------


def _osfarm_imports(modules: dict[str, Path], found: list[Import]) -> Iterator[tuple[Import, str]]:
    """Each import of an osfarm module, with the module it lands in."""
    for imp in found:
        if internal(imp):
            yield imp, owner(imp.target, modules)


def upward_imports(modules: dict[str, Path], found: list[Import]) -> list[str]:
    bad = []
    for imp, target in _osfarm_imports(modules, found):
        src, dst = layer_of(imp.source), layer_of(target)
        if dst is None:
            continue  # neutral modules are everyone's
        if src is None or dst > src:
            bad.append(f"{where(imp, modules)}: {imp.source} ({layer_name(src)}) imports {target} ({layer_name(dst)})")
    return sorted(set(bad))


def imports_across_a_layer(modules: dict[str, Path], found: list[Import]) -> list[str]:
    """Imports between two packages of one layer that ACROSS does not allow."""
    bad = []
    for imp, target in _osfarm_imports(modules, found):
        src, dst = package_of(imp.source), package_of(target)
        if src is None or dst is None or src == dst or layer_of(imp.source) != layer_of(target):
            continue
        if (src, dst) not in ACROSS:
            allowed = [f"{a} -> {b}" for a, b in ACROSS if {a, b} == {src, dst}]
            bad.append(f"{where(imp, modules)}: {imp.source} imports {target}"
                       + (f" (this layer's direction is {allowed[0]})" if allowed else
                          f" ({src} and {dst} import none of each other)"))
    return sorted(set(bad))


def unused_across(modules: dict[str, Path], found: list[Import]) -> list[str]:
    """ACROSS entries no import makes: a direction kept for imports that moved away (a module
    moved to another package) would let them come back unseen."""
    used = {(package_of(imp.source), package_of(target)) for imp, target in _osfarm_imports(modules, found)}
    return sorted(f"{a} -> {b}" for a, b in ACROSS if (a, b) not in used)


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


def import_cycles(modules: dict[str, Path], found: list[Import]) -> list[str]:
    """Every cycle among ``modules`` (TYPE_CHECKING and function-local imports counted), with the
    imports that make it."""
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for imp in found:
        target = owner(imp.target, modules)
        if not target or target == imp.source:
            continue
        edges.setdefault(imp.source, set()).add(target)
        lines.setdefault((imp.source, target), where(imp, modules) + (" (function-local)" if imp.local else ""))
    report = []
    for comp in _cycles(set(modules), edges):
        members = set(comp)
        report.append("cycle: " + ", ".join(comp))
        report += [f"    {lines[(a, b)]}: {a} -> {b}" for a in comp for b in sorted(edges.get(a, ())) if b in members]
    return report


# Programs osfarm copies into another interpreter and runs there, never imported by osfarm: their
# imports sit where a failure can be reported back over their protocol instead of killing them.
SHIPPED_PROGRAMS = {
    "osfarm.desktop.box.code_kernel": "the code runner's interpreter; may be the guest's own python3",
}


def unlisted_local_imports(modules: dict[str, Path], found: list[Import]) -> list[str]:
    bad = []
    for imp in found:
        if not imp.local or imp.type_only or is_command_module(imp.source) or imp.source in SHIPPED_PROGRAMS:
            continue
        if internal(imp):
            if owner(imp.target, modules) in LAZY_OSFARM:
                continue
        elif imp.target.split(".")[0] in LAZY_THIRD_PARTY:
            continue
        bad.append(f"{where(imp, modules)}: {imp.target}")
    return sorted(set(bad))


def bench_import_problems(bench: tuple[dict[str, Path], list[Import]], osfarm_modules: dict[str, Path]) -> list[str]:
    """A bench script imports osfarm modules that exist (its helpers from osfarm.testing), the
    other bench scripts and third-party packages: nothing of tests/."""
    modules, found = bench
    bad = []
    for imp in found:
        if internal(imp):
            if owner(imp.target, osfarm_modules) != imp.target:
                bad.append(f"{where(imp, modules)}: {imp.target} is no osfarm module")
        elif imp.target.startswith("tests:"):
            bad.append(f"{where(imp, modules)}: test helper {imp.target.removeprefix('tests:')} (a bench script "
                       "imports no module of tests/: a shared helper belongs in osfarm.testing)")
        elif imp.target not in modules and imp.target.split(".")[0] in ("tests", "bench"):
            bad.append(f"{where(imp, modules)}: {imp.target} (a bench script imports a script by its bare name)")
    return sorted(set(bad))


def imports_of_bench_or_tests(modules: dict[str, Path], found: list[Import], names: set[str]) -> list[str]:
    """osfarm importing a bench script or a test helper (``names``: their bare names), or the
    ``bench``/``tests`` folders as packages."""
    return sorted({f"{where(imp, modules)}: {imp.source} imports {imp.target}" for imp in found
                   if imp.target.split(".")[0] in names | {"bench", "tests"}})


# -- osfarm and bench as they are --------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> tuple[dict[str, Path], list[Import]]:
    return graph()


@pytest.fixture(scope="module")
def bench() -> tuple[dict[str, Path], list[Import]]:
    return bench_graph()


def test_every_module_has_a_layer(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, _ = imports
    for name in modules:
        layer_of(name)


def test_imports_point_down(imports: tuple[dict[str, Path], list[Import]]) -> None:
    bad = upward_imports(*imports)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_imports_inside_a_layer_go_its_one_way(imports: tuple[dict[str, Path], list[Import]]) -> None:
    bad = imports_across_a_layer(*imports)
    assert not bad, "imports between the packages of one layer that ACROSS does not allow:\n" + "\n".join(bad)


def test_the_farm_imports_nothing_of_runner_agents_trainer(imports: tuple[dict[str, Path], list[Import]]) -> None:
    # Implied by the layers; spelt out because it is the rule that matters most (DESIGN.md).
    modules, found = imports
    banned = ("osfarm.runner", "osfarm.agents", "osfarm.trainer", "osfarm.policy", "osfarm.env")
    bad = [f"{where(i, modules)}: {i.target}" for i in found
           if i.source.startswith("osfarm.farm") and i.target.startswith(banned)]
    assert not bad, "\n".join(bad)


def test_the_wire_layer_imports_only_itself_and_the_error_base(imports: tuple[dict[str, Path], list[Import]]) -> None:
    # Stricter than "points down": the neutral modules (settings, HTTP helpers) are no business of a
    # wire model, which a client, a guest and a record reader all load.
    modules, found = imports
    bad = [f"{where(i, modules)}: {i.target}" for i in found if i.source.startswith("osfarm.schema")
           and i.target.startswith("osfarm") and not i.target.startswith(("osfarm.schema", "osfarm.errors"))]
    assert not bad, "\n".join(bad)


def test_across_is_one_way() -> None:
    edges: dict[str, set[str]] = {}
    for importer, imported in ACROSS:
        edges.setdefault(importer, set()).add(imported)
    assert _cycles({p for pair in ACROSS for p in pair}, edges) == []


def test_every_across_entry_is_used(imports: tuple[dict[str, Path], list[Import]]) -> None:
    assert unused_across(*imports) == [], "ACROSS entries no import makes (remove them):"


def test_no_import_cycles(imports: tuple[dict[str, Path], list[Import]],
                          bench: tuple[dict[str, Path], list[Import]]) -> None:
    modules, found = imports
    bench_modules, bench_found = bench
    report = import_cycles({**modules, **bench_modules}, found + bench_found)
    assert not report, "\n".join(report)


def test_function_local_imports_are_on_the_allow_list(imports: tuple[dict[str, Path], list[Import]]) -> None:
    bad = unlisted_local_imports(*imports)
    assert not bad, ("function-local imports of neither a heavy optional dependency nor an allowed "
                     "osfarm module (move them to the top, or add them to the allow-list with a reason):\n"
                     + "\n".join(bad))


def test_bench_imports_osfarm_and_its_own_helpers(imports: tuple[dict[str, Path], list[Import]],
                                                  bench: tuple[dict[str, Path], list[Import]]) -> None:
    bad = bench_import_problems(bench, imports[0])
    assert not bad, "\n".join(bad)


def test_osfarm_imports_no_bench_script_or_test_helper(imports: tuple[dict[str, Path], list[Import]],
                                                       bench: tuple[dict[str, Path], list[Import]]) -> None:
    names = {m.removeprefix("bench.") for m in bench[0]} | helper_names()
    bad = imports_of_bench_or_tests(*imports, names)
    assert not bad, "\n".join(bad)


def imports_of_testing(modules: dict[str, Path], found: list[Import]) -> list[str]:
    """osfarm modules outside osfarm.testing that import it (the layers allow only the command)."""
    return sorted({f"{where(imp, modules)}: {imp.source} imports {target}"
                   for imp, target in _osfarm_imports(modules, found)
                   if target.startswith("osfarm.testing") and not imp.source.startswith("osfarm.testing")})


def test_only_tests_and_bench_import_osfarm_testing(imports: tuple[dict[str, Path], list[Import]]) -> None:
    bad = imports_of_testing(*imports)
    assert not bad, "osfarm.testing is for tests and benches; osfarm itself imports none of it:\n" + "\n".join(bad)
    modules, _ = imports
    cli = Import("osfarm.cli.serve", "osfarm.testing.farms", 7, True, False)
    assert len(imports_of_testing(modules, [cli])) == 1  # a command reaching for it is caught


def test_the_allow_lists_name_real_modules(imports: tuple[dict[str, Path], list[Import]]) -> None:
    modules, _ = imports
    assert [m for m in LAZY_OSFARM if m not in modules] == []
    assert [m for m in NEUTRAL if m not in modules] == []
    assert [m for m in SHIPPED_PROGRAMS if m not in modules] == []
    assert [p for pair in ACROSS for p in pair if p not in modules] == []


# -- the checker on made-up code: a silent checker cannot pass the tests above -----------------------


def test_the_checker_sees_what_it_must() -> None:
    # The walker on a made-up module: a nested function-local import, a relative import, a
    # TYPE_CHECKING import.
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


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_checker_catches_a_type_checking_cycle(tmp_path: Path) -> None:
    # The desktop's warm/fingerprint/x_reset circle in small: one side imports at run time, the
    # other only for its annotations.
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/warm.py": "from pkg.x_reset import x_reset\n\nclass Baseline: ...\n",
        "pkg/x_reset.py": ("from __future__ import annotations\n"
                           "import typing\n"
                           "if typing.TYPE_CHECKING:\n"
                           "    from pkg.warm import Baseline\n"
                           "def x_reset(base: Baseline) -> None: ...\n"),
        "pkg/other.py": "from pkg import warm\n",
    })
    report = import_cycles(*graph(tmp_path / "pkg"))
    assert report[0] == "cycle: pkg.warm, pkg.x_reset"
    assert any("pkg/x_reset.py:4 (TYPE_CHECKING): pkg.x_reset -> pkg.warm" in line for line in report), report
    assert len([line for line in report if line.startswith("cycle")]) == 1  # pkg.other is not in it
    # and the same package without the annotation's import has none
    (tmp_path / "pkg/x_reset.py").write_text("def x_reset(base: object) -> None: ...\n")
    assert import_cycles(*graph(tmp_path / "pkg")) == []


def test_the_checker_catches_an_import_against_a_layers_direction() -> None:
    modules = all_modules()
    back = Import("osfarm.evaluators.getters.env", "osfarm.tasks.controller", 28, False, True)
    forth = Import("osfarm.tasks.lifecycle", "osfarm.evaluators.scoring", 24, False, False)
    sideways = Import("osfarm.stream.jsonl", "osfarm.agents.base", 1, False, False)
    neutral = Import("osfarm.evaluators.getters.env", "osfarm.host_paths", 28, False, False)
    bad = imports_across_a_layer(modules, [back, forth, sideways, neutral])
    assert len(bad) == 2, bad
    assert "osfarm.evaluators.getters.env imports osfarm.tasks.controller (this layer's direction is " \
           "osfarm.tasks -> osfarm.evaluators)" in bad[0]
    assert "osfarm.stream and osfarm.agents import none of each other" in bad[1]
    # inside desktop (importer, imported, under TYPE_CHECKING): X reading the guest server, the
    # session naming warm's types, box and x11 side by side; and the guest's routes running warm
    desktop = [("x11.capture", "guest.guest", False), ("session.guest_state", "warm.warm", True),
               ("box.commands", "x11.xserver", False), ("guest.native_routes", "warm.warm", False)]
    bad = imports_across_a_layer(modules, [Import(f"osfarm.desktop.{a}", f"osfarm.desktop.{b}", 1, False, typed)
                                           for a, b, typed in desktop])
    assert len(bad) == 3, bad
    assert "osfarm.desktop.x11.capture imports osfarm.desktop.guest.guest (this layer's direction is " \
           "osfarm.desktop.guest -> osfarm.desktop.x11)" in bad[2]
    assert "(TYPE_CHECKING): osfarm.desktop.session.guest_state imports osfarm.desktop.warm.warm" in bad[1]
    assert "osfarm.desktop.box and osfarm.desktop.x11 import none of each other" in bad[0]
    # and a two-way ACROSS is a cycle
    assert _cycles({"a", "b"}, {"a": {"b"}, "b": {"a"}}) == [["a", "b"]]


def test_the_checker_reads_bench(tmp_path: Path) -> None:
    _write(tmp_path, {
        "bench/farmproc.py": "import httpx\n",
        "bench/a.py": ("import sys\nfrom farmproc import x\nfrom farm_process import FarmProcess\n"
                       "from boxes import Box\nfrom osfarm.client import Farm\nfrom osfarm.no_such import y\n"),
        "bench/b.py": "def main():\n    import a\n",
        "bench/c.py": "import b\n",
    })
    modules, found = bench_graph(tmp_path / "bench", helpers={"farm_process", "boxes"})
    targets = {(i.source, i.target) for i in found}
    assert {("bench.a", "bench.farmproc"), ("bench.a", "tests:farm_process"), ("bench.b", "bench.a"),
            ("bench.c", "bench.b")} <= targets
    bad = bench_import_problems((modules, found), all_modules())
    assert len(bad) == 3, bad
    assert "test helper farm_process (a bench script imports no module of tests/" in bad[0]
    assert "test helper boxes" in bad[1] and "osfarm.no_such is no osfarm module" in bad[2]
    # and an osfarm module importing a bench script or a test helper
    mine = {"osfarm.env": ROOT / "env.py"}
    sneaky = [Import("osfarm.env", "farmproc", 3, True, False), Import("osfarm.env", "tests.farms", 4, False, False),
              Import("osfarm.env", "httpx", 5, False, False)]
    assert len(imports_of_bench_or_tests(mine, sneaky, {"farmproc", "farms"})) == 2

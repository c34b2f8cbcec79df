"""The house rules, read from the code's imports (ast, every import at any depth, TYPE_CHECKING ones included):
no import circles; the packages import one way, by rank (kernels < model < decoding, protocols, tools < backends <
engine < serving, training < the page), the shared leaves importing only leaves; app/ never imports components/
or gradio; C is reached only through app/kernels/; the page (components/, app.py) imports only the packages' faces
and the shared leaves, never a package's inner module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "components")
LEAVES = {"app", "app.settings", "app.episode", "app.paths", "app.threads"}
PAGE_FACES = {"app.engine", "app.backends", "app.serving", "app.tools"}
# Lower never imports higher; the same rank may (no circle aside). Shared leaves sit below everything.
RANKS = {"app.kernels": 1, "app.model": 2, "app.decoding": 3, "app.protocols": 3, "app.tools": 3, "app.backends": 4,
         "app.engine": 5, "app.serving": 6, "app.training": 6, "app.cli": 7, "app.__main__": 7, "components": 7,
         "app_py": 7}


def rank(module: str) -> int | None:
    """A module's rank: its package's (RANKS), 0 for a shared leaf, None for a package RANKS does not name."""
    if module in LEAVES:
        return 0
    for prefix in (module, ".".join(module.split(".")[:2]), module.split(".")[0]):
        if prefix in RANKS:
            return RANKS[prefix]
    return None


def module_files() -> dict[str, Path]:
    """Module name -> file, for app/, components/ and app.py (as "app_py": `app` is the package)."""
    found = {"app_py": ROOT / "app.py"}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name an import in `path` names (modules and `module.name` for from-imports)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: set[str]) -> str | None:
    """The project module a dotted name lands in (its longest prefix that is one), or None (outside)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project module -> project modules it imports, module -> every dotted name it imports)."""
    files = module_files()
    raw = {m: imported_names(path, m) for m, path in files.items()}
    graph = {}
    for m, names in raw.items():
        targets = {resolve(n, set(files)) for n in names} - {None, m}
        # a module's own package's __init__ runs before it anyway: importing a sibling through it is no circle
        graph[m] = {t for t in targets if not (m.startswith(t + ".") and files[t].name == "__init__.py")}
    return graph, raw


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def broken_rules(graph: dict[str, set[str]], raw: dict[str, set[str]]) -> list[str]:
    """Every house rule the imports break, one line each (empty: the house is in order)."""
    problems = [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    problems += [f"{m} has no rank: add its package to RANKS" for m in sorted(graph) if rank(m) is None]
    for m in sorted(m for m in graph if rank(m) is not None):
        for target in sorted(t for t in graph[m] if (rank(t) or 0) > rank(m)):
            problems.append(f"{m} imports {target}: rank {rank(m)} imports only ranks up to its own, not {rank(target)}")
    for m, names in sorted(raw.items()):
        tops = {n.split(".")[0] for n in names}
        in_app = m == "app" or m.startswith("app.")
        in_kernels = m.startswith("app.kernels")
        if in_app and tops & {"components", "gradio"}:
            problems.append(f"{m} imports {sorted(tops & {'components', 'gradio'})}: app/ has no UI imports")
        if "trl" in tops and not m.startswith("app.training"):
            problems.append(f"{m} imports trl: only app/training/ does (requirements-train.txt, optional)")
        if "ctypes" in tops and not in_kernels:
            problems.append(f"{m} imports ctypes: C is reached only through app/kernels/")
        if in_app and not in_kernels and any(t.startswith("app.kernels.native") for t in graph[m]):
            problems.append(f"{m} imports app.kernels.native: only the kernels' bindings load the C library")
        if not in_app:  # the page: components/ and app.py
            for target in sorted(t for t in graph[m] if t.startswith("app")):
                if target not in LEAVES and target not in PAGE_FACES:
                    problems.append(f"{m} imports {target}: the page imports only a package's face or a shared leaf")
    return problems


def test_the_project_keeps_the_house_rules():
    graph, raw = import_graph()
    assert broken_rules(graph, raw) == []


def test_c_sources_live_only_in_the_kernels_package():
    stray = [p.relative_to(ROOT) for p in (ROOT / "app").rglob("*.[ch]") if p.parent != ROOT / "app" / "kernels"]
    assert stray == []
    assert sorted(p.name for p in (ROOT / "app" / "kernels").glob("*.c"))  # (the build reads them from there)


@pytest.mark.parametrize("graph, raw, expected", [
    ({"app.a": {"app.b"}, "app.b": {"app.c"}, "app.c": {"app.a"}}, {}, "import circle: app.a -> app.b -> app.c"),
    ({"app.a": set()}, {"app.a": {"components.chat"}}, "app.a imports ['components']"),
    ({"app.a": set()}, {"app.a": {"gradio"}}, "app.a imports ['gradio']"),
    ({"app.model.int8": set()}, {"app.model.int8": {"ctypes"}}, "app.model.int8 imports ctypes"),
    ({"app.model.int8": {"app.kernels.native"}}, {"app.model.int8": {"app.kernels.native"}},
     "app.model.int8 imports app.kernels.native"),
    ({"components.chat": {"app.model.kvcache"}}, {"components.chat": {"app.model.kvcache"}},
     "components.chat imports app.model.kvcache"),
    ({"app_py": {"app.backends.server"}}, {"app_py": {"app.backends.server"}}, "app_py imports app.backends.server"),
    ({"app.model.loading": {"app.decoding.guide_matcher"}, "app.decoding.guide_matcher": set()}, {},
     "app.model.loading imports app.decoding.guide_matcher: rank 2"),
    ({"app.engine.engine": {"app.serving.sessions"}, "app.serving.sessions": set()}, {},
     "app.engine.engine imports app.serving.sessions: rank 5"),
    ({"app.episode": {"app.decoding.stops"}, "app.decoding.stops": set()}, {}, "app.episode imports app.decoding.stops"),
    ({"app.newpkg.x": set()}, {}, "app.newpkg.x has no rank"),
    ({"app.engine.x": set()}, {"app.engine.x": {"trl.trainer"}}, "app.engine.x imports trl"),
])
def test_each_rule_catches_what_it_forbids(graph, raw, expected):
    """Each rule fails on a tree that breaks it (so the test above can fail)."""
    full_raw = {m: raw.get(m, set()) | graph[m] for m in graph}
    problems = broken_rules(graph, full_raw)
    assert any(p.startswith(expected) for p in problems), problems


def test_faces_and_inner_modules_are_told_apart():
    """A face import passes and a kernels binding may load the library: the rules forbid only what they name."""
    graph = {"components.chat": {"app.engine", "app.episode"}, "app.kernels.int8_mm": {"app.kernels.native"},
             "app.engine": {"app.model"}, "app.episode": set(), "app.kernels.native": set(), "app.model": set()}
    raw = {"components.chat": {"app.engine", "app.episode"}, "app.kernels.int8_mm": {"app.kernels.native"},
           "app.kernels.native": {"ctypes"}, "app.engine": set(), "app.episode": set()}
    assert broken_rules(graph, raw) == []


def test_each_protocol_lives_in_one_place():
    """textenv is all in app/protocols/textenv/ (markers, parser, prompt, grammar), as chat is in app/protocols/:
    no app/protocol.py, and nothing outside app/protocols reaches into textenv's modules (the page asks the Protocol
    interface, e.g. Episode.answered, never a protocol's markers)."""
    assert not (ROOT / "app" / "protocol.py").exists()
    graph, _ = import_graph()
    inside = [m for m in graph if m.startswith("app.protocols.textenv")]
    outside = {m: sorted(n for n in names if n.startswith("app.protocols.textenv.") and n.count(".") > 2)
               for m, names in graph.items() if m not in inside and not m.startswith("app.protocols")}
    assert {m: n for m, n in outside.items() if n} == {}


def test_the_page_leaves_the_turn_to_serving():
    """Serving runs every model job (Service.stream_turn, ask, stream_batch, compare): the page never takes a place
    under the KV budget, does the admission arithmetic, trims the budget or runs a turn on a thread itself."""
    words = ("turn_slot", "turn_room", "kv_reserve", "kv_after", "chat_slot", "job_slot", "enforce_budget",
             "in_batches", ".turn(session", "stream_batch(questions")
    page = [ROOT / "app.py", *(ROOT / "components").rglob("*.py")]
    assert [(p.name, w) for p in page for w in words if w in p.read_text()] == []


def test_the_page_holds_the_service_and_is_not_one():
    """Composition, not mixins: no class of the page's derives from another of its own or from serving's (each
    holds the Service it is given); the store and the service do not call each other back."""
    derived = [(p.name, node.name) for p in (ROOT / "components").rglob("*.py")
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef) and any(isinstance(base, ast.Name) and base.id[0].isupper()
                                                         for base in node.bases)]
    assert derived == []
    sessions = (ROOT / "app" / "serving" / "sessions.py").read_text()
    imported = import_graph()[0]["app.serving.sessions"]
    assert "release_shared" not in sessions and not [m for m in imported if m.startswith("app.serving")]


def test_a_model_segment_has_one_owner():
    """Issue 57: a model segment's tokens are the backend's to write. Forced ones (the guide's opening, what its grammar
    fixes) go in through one path, SegmentTokens.force, which alone builds a run of forced provenance; the engine
    builds no model Segment of its own; the scheduler updates its own Row type (no callback interface of a caller's
    layer, typing.Protocol)."""
    app = ROOT / "app"
    forcing = sorted(str(p.relative_to(app)) for p in app.rglob("*.py") if "[Provenance.FORCED] *" in p.read_text())
    assert forcing == ["backends/tokens.py"]
    engine = [p.name for p in (app / "engine").glob("*.py") if 'Segment("model"' in p.read_text()]
    assert engine == []
    scheduler = (app / "backends" / "scheduler.py").read_text()
    assert "Protocol" not in scheduler and "from app.backends.row import Row" in scheduler


def test_page_updates_are_named_not_padded():
    """Handlers return typed updates that layout.py wires as {component: value}: no tuple of gr.skip() pads an
    output list, and no handler's output is read by position."""
    padded = [p.name for p in (ROOT / "components").rglob("*.py") if "(gr.skip(),)" in p.read_text()]
    assert padded == []


# Private names the tests may read: not app's (torch's, transformers', the standard library's, gguf's converter's).
NOT_APP_PRIVATE = {"_int_mm", "_attn_implementation", "_ncallbacks", "_create_vocab_sentencepiece"}
OWN = {"self", "cls"}  # a test's own classes' state
NAMING = {"getattr", "setattr", "hasattr", "delattr"}  # (and monkeypatch.setattr / delattr) with the name as a string


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NOT_APP_PRIVATE


def private_reads(source: str) -> list[str]:
    """Each private name of app's that `source` (a test file) reads, one line each: `x._name` (not self's or cls's),
    `from app... import _name`, and the name given as a string to getattr, setattr or monkeypatch.setattr."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and \
                not (isinstance(node.value, ast.Name) and node.value.id in OWN):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "app":
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str) and is_private(node.args[1].value) and \
                (getattr(node.func, "id", None) in NAMING or getattr(node.func, "attr", None) in NAMING) and \
                not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN):
            found.append(f"line {node.lineno}: {node.args[1].value!r}")
    return found


def test_tests_read_no_private_names_of_app():
    """Issue 57: the tests go through app's public interfaces (e.g. Scheduler.thread, SessionStore.waiting(),
    Int8Linear.prepared), never its `_private` attributes, functions or module names."""
    tests = [p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_house_rules.py"]
    found = {str(p.relative_to(ROOT)): private_reads(p.read_text()) for p in tests}
    assert {path: reads for path, reads in found.items() if reads} == {}


@pytest.mark.parametrize("source, expected", [
    ("scheduler._thread.join()", ["line 1: ._thread"]),
    ("from app.model.ragged import _attend, causal_mask", ["line 1: import _attend"]),
    ("monkeypatch.setattr(scheduler, '_plan', gathered)", ["line 1: '_plan'"]),
    ("n = getattr(store, '_running')", ["line 1: '_running'"]),
    ("self._process = None\ncls._made = 1\ngetattr(self, '_past', None)\ntorch._int_mm(a, b)\nx.__dict__\n"
     "from tests.conftest import _tiny", []),
])
def test_the_private_names_rule_tells_reads_apart(source, expected):
    """The rule catches each form of a private read (so the test above can fail) and passes what it allows."""
    assert private_reads(source) == expected

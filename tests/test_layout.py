"""The shape of the house (docs/development.md draws it): which part of dlojzlib may import which,
no module importing itself back through others, files of at most 600 lines, and a repository root
that holds the design card's files and the launchers.

Imports are read from the sources (ast, lazy ones inside functions too), not by importing them.

python -m pytest -q tests/test_layout.py"""
import ast
import glob
import os

import pytest

from conftest import ROOT

# Each part and the parts it may import. A module's part is its folder under dlojzlib/, or its row
# below; flags reads the data path and the launch to resolve machine-dependent defaults
# (check_args), and the data path reads the flags it is given (RandAugment's N,M).
BASE = {'dlojzlib', 'dlojzlib.errors', 'dlojzlib.failpoints', 'dlojzlib.host', 'dlojzlib.compat',
        'dlojzlib.files', 'dlojzlib.tables', 'dlojzlib.environment', 'dlojzlib.choices',
        'dlojzlib.readers', 'dlojzlib.formats'}
CORE = {'dlojzlib.recipe', 'dlojzlib.metrics'}
LAUNCHERS = {'dlojz_report', 'dlojz_data', 'dlojz_slurm', 'dlojz_scaling', 'dlojz_bench',
             'dlojz_loader', 'dlojz_export'}
LIBRARY = {'base', 'flags', 'core', 'data', 'dist', 'measure', 'chrono', 'record', 'models'}
ALLOWED = {
    'base': set(),
    'dist': {'base'},
    'flags': {'base', 'data', 'dist'},
    'data': {'base', 'dist', 'flags'},        # never the record, the modes or the tools
    'core': {'base', 'dist', 'flags'},
    'models': {'flags'},
    'measure': {'base', 'dist', 'flags', 'core'},
    'chrono': {'base', 'measure'},
    'record': {'base', 'dist', 'flags', 'core', 'measure', 'chrono'},
    'modes': LIBRARY - {'modes'},
    'tools': LIBRARY,                         # the library, never the modes; nothing imports a tool
    'lightning': LIBRARY,                     # optional (Lightning): nothing imports it
    'launchers': {'data', 'measure', 'modes', 'tools'},
    'script': LIBRARY | {'modes'},            # dlojz.py
}


def part(module):
    if module in BASE:
        return 'base'
    if module in CORE:
        return 'core'
    if module == 'dlojzlib.flags':
        return 'flags'
    if module.startswith('dlojzlib.'):
        return module.split('.')[1]
    return {'dlojz': 'script', 'dlojz_chrono': 'chrono', 'custom_models': 'models'}.get(
        module, 'launchers' if module in LAUNCHERS else None)


def modules(root=ROOT):
    """{dotted name: path} of the package's modules and the root's Python files."""
    found = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(root, '*.py'))}
    for p in glob.glob(os.path.join(root, 'dlojzlib', '**', '*.py'), recursive=True):
        name = os.path.relpath(p, root)[:-3].replace(os.sep, '.')
        found[name.removesuffix('.__init__')] = p
    return found


def import_graph(root=ROOT):
    """{module: set of the repository's modules it imports}, at any depth in the file."""
    mods = modules(root)
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from dlojzlib.data import decode` imports the module dlojzlib.data.decode
                deps |= {node.module} | {f'{node.module}.{a.name}' for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def violations(graph):
    """(importer, imported) pairs that cross parts against ALLOWED."""
    bad = []
    for name, deps in graph.items():
        mine = part(name)
        for dep in deps:
            theirs = part(dep)
            if theirs != mine and theirs not in ALLOWED[mine] and dep != 'dlojzlib':
                bad.append((name, dep))
    return sorted(bad)


def cycles(graph):
    """Modules that reach themselves through their imports."""
    def reach(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return seen
    return sorted(m for m in graph if m in reach(m))


def test_every_module_has_a_part():
    assert {m: part(m) for m in modules() if part(m) not in ALLOWED} == {}


def test_each_part_imports_only_what_its_row_allows():
    assert violations(import_graph()) == []


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize('edge', [
    ('dlojzlib.data.decode', 'dlojzlib.record.log'),       # data never imports the record
    ('dlojzlib.measure.scaling', 'dlojzlib.tools.slurm'),  # the library never imports a tool
    ('dlojzlib.record.summary', 'dlojzlib.modes.tune'),    # nor a mode
    ('dlojzlib.errors', 'dlojz'),                          # nor the script
])
def test_a_forbidden_import_is_caught(edge):
    """The check can fail: each edge, added to the real graph, is reported by name."""
    graph = import_graph()
    graph[edge[0]] = graph[edge[0]] | {edge[1]}
    assert edge in violations(graph)


def test_a_circle_is_caught():
    graph = import_graph()
    assert 'dlojzlib.data.decode' in graph['dlojzlib.data.datasets']
    graph['dlojzlib.data.decode'] = graph['dlojzlib.data.decode'] | {'dlojzlib.data.datasets'}
    assert {'dlojzlib.data.decode', 'dlojzlib.data.datasets'} <= set(cycles(graph))


def test_rooms_stay_small():
    """STYLE.md's shape: every file at most 600 lines (dlojz.py: main and its loops, not the modes
    around them; the report: a file per view)."""
    sizes = {os.path.relpath(p, ROOT): sum(1 for _ in open(p)) for p in modules().values()}
    assert {name: n for name, n in sizes.items() if n > 600} == {}


def test_the_root_holds_the_card_and_thin_launchers():
    """The design card's files, and a launcher of a few lines for each command users type."""
    root = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, '*.py'))}
    card = {'dlojz.py', 'dlojz_chrono.py', 'custom_models.py'}
    assert root == card | {f'{m}.py' for m in LAUNCHERS}
    for m in LAUNCHERS:
        with open(os.path.join(ROOT, f'{m}.py')) as f:
            assert sum(1 for _ in f) <= 10, m

"""The GPU run's results by test name, from pytest's JUnit XML and the progress file (progress.py):
each test's outcome and seconds, the test a time limit stopped while it ran, then the tests that
were asked for and never ran (a stage's time budget ran out). bash tests/gpu/run.sh prints it last
and keeps it as summary.md in the results folder, ready for BENCHMARKS.md; its exit code is the
stage's verdict: 0 when every test that ran passed or was skipped, 1 otherwise (a failure, an error,
a test stopped while it ran, or no record at all). Tests left out by the budget are listed, not
counted as failures. entries() reads the lists (quick.txt): each test's planned seconds, which
tests/test_gpu_runner.py sums against its call's budget and tests/gpu/conftest.py turns into limits.

    python tests/gpu/results.py RESULTS/junit.xml [--progress RESULTS/progress.txt]
                                [--list tests/gpu/quick.txt]
"""
import argparse
import collections
import math
import sys
import xml.etree.ElementTree as ET

BAD = ('failed', 'error', 'interrupted', 'unknown')  # outcomes that make the verdict 1


def node_of(case):
    """A <testcase>'s pytest node id, as far as JUnit keeps it: tests.gpu.test_gpu + name ->
    tests/gpu/test_gpu.py::name (a class's tests: tests/gpu/test_a.py::TestK::name, matched by
    junit_key); None for the nameless case pytest writes for a test a KeyboardInterrupt stopped."""
    name, classname = case.get('name'), case.get('classname')
    if not name or not classname:
        return None
    return f"{classname.replace('.', '/')}.py::{name}"


def junit_key(node):
    """A pytest node id as JUnit writes it: (classname, name), so that a JUnit row and the progress
    file's id of the same test meet, in a class too: tests/gpu/test_a.py::TestK::test_x[p] ->
    ('tests.gpu.test_a.TestK', 'test_x[p]')."""
    path, _, rest = node.partition('::')
    parts = rest.split('::')
    module = path[:-3] if path.endswith('.py') else path
    return '.'.join([module.replace('/', '.'), *parts[:-1]]), parts[-1]


def outcomes(junit_path):
    """-> [(node id or None, outcome, seconds, message)] in the order the tests ran."""
    rows = []
    for case in ET.parse(junit_path).getroot().iter('testcase'):
        outcome, message = 'passed', ''
        for tag in ('failure', 'error', 'skipped'):
            found = case.find(tag)
            if found is not None:
                outcome = {'failure': 'failed', 'error': 'error', 'skipped': 'skipped'}[tag]
                message = (found.get('message') or '').split('\n')[0][:160]
                break
        node = node_of(case)
        if node is None:
            outcome, message = 'interrupted', 'stopped while it ran'
        try:
            seconds = float(case.get('time') or 0.0)
        except ValueError:
            seconds = 0.0
        rows.append((node, outcome, seconds, message))
    return rows


def read_progress(text):
    """progress.txt's text -> (node ids started, in order; node ids that ended). Lines that are not
    an event (a line cut by a kill, an empty line) are left out."""
    started, ended = [], set()
    for line in text.splitlines():
        event, sep, node = line.partition('\t')
        if not sep or not node:
            continue
        if event == 'start':
            started.append(node)
        elif event == 'end':
            ended.add(node)
    return started, ended


def merge(rows, started, ended):
    """JUnit's rows named from the progress file: the test started and never ended is the one a time
    limit stopped (JUnit's nameless case, or no case at all when pytest was killed); a test that
    ended but is missing from JUnit ran and lost its outcome (pytest killed before it wrote the
    XML)."""
    by_key = {junit_key(node): node for node in started}
    named = [(by_key.get(junit_key(r[0]), r[0]), *r[1:]) for r in rows if r[0] is not None]
    nameless = [r for r in rows if r[0] is None]
    have = {r[0] for r in named}
    merged = list(named)
    for node in dict.fromkeys(started):
        if node in have:
            continue
        if node not in ended:
            seconds = nameless.pop(0)[2] if nameless else 0.0
            merged.append((node, 'interrupted', seconds, 'stopped by a time limit while it ran'))
        else:
            merged.append((node, 'unknown', 0.0, 'ran; its outcome was lost (pytest was killed)'))
    return merged + nameless  # nameless cases the progress file could not name stay, unnamed


BASES = ('measured', 'estimated')  # where a list line's seconds come from


def entries(list_path):
    """A list like quick.txt -> [(node id, seconds or None, basis or None)] in its order. A line is
    `NODE_ID [SECONDS BASIS]`: the test's pytest node id (one without [...] runs every case), then
    the seconds all its cases are planned to take and where that figure comes from, 'measured' (a
    GPU run, BENCHMARKS.md) or 'estimated'. Lines starting with # and blank lines are left out; a
    rerun list of ids alone (failed.txt) has no budgets."""
    rows = []
    with open(list_path, encoding='utf-8') as f:
        for line in f:
            fields = line.split()
            if not fields or fields[0].startswith('#'):
                continue
            seconds = basis = None
            if len(fields) > 1:
                try:
                    seconds = float(fields[1])
                except ValueError:
                    pass
                basis = fields[2] if len(fields) > 2 else None
            rows.append((fields[0], seconds, basis))
    return rows


def asked(list_path):
    """The node ids of a list like quick.txt, parametrised ones included as given."""
    return [node for node, _, _ in entries(list_path)]


def planned(list_path):
    """The seconds a list's tests are planned to take, all lines together (lines without a budget
    count 0: the budget test requires one on every line of the committed lists)."""
    return sum(seconds or 0.0 for _, seconds, _ in entries(list_path))


def timeout_for(seconds, default=120):
    """A test's own time limit (pytest-timeout) from its planned seconds: run.sh's default, or
    twice the plan for a test planned above half of it (a cold torch.compile), so that the limit
    stops a hung test, not a slow compile the stage's budget has room for."""
    return max(default, math.ceil(2 * seconds)) if seconds else default


def not_run(rows, wanted):
    """The tests of `wanted` of which no case ran (a node id without [...] matches its parametrised
    cases)."""
    ran = {node for node, *_ in rows if node}
    return [w for w in wanted if w not in ran and not any(r.startswith(w + '[') for r in ran)]


def short(node):
    if node and '::' in node:
        return node.split('::', 1)[1]
    return node or 'a test (name not recorded)'


def table(rows, missing=()):
    lines = ['| test | result | s |', '|---|---|---:|']
    for node, outcome, seconds, message in rows:
        result = f"{outcome}: {message.replace('|', '/')}" if message else outcome
        lines.append(f"| `{short(node)}` | {result} | {seconds:.1f} |")
    lines += [f"| `{short(node)}` | not run | |" for node in missing]
    counts = collections.Counter(outcome for _, outcome, _, _ in rows)
    said = [f'{n} {outcome}' for outcome, n in sorted(counts.items())]
    # the test budget ran out, or the session ended before them (log.txt says which)
    said += [f'{len(missing)} not run'] if missing else []
    seconds = sum(t for _, _, t, _ in rows)
    return lines + ['', f"{', '.join(said) or 'no test ran'}; {seconds:.0f} s in tests."]


def verdict(rows):
    """0 when tests ran and none of them went wrong, else 1."""
    return 1 if not rows or any(outcome in BAD for _, outcome, _, _ in rows) else 0


def main(argv):
    p = argparse.ArgumentParser(
        description='the GPU tests by name, from junit.xml and progress.txt')
    p.add_argument('junit')
    p.add_argument('--progress', help='progress.txt (tests/gpu/progress.py)')
    p.add_argument('--list',
                   help='the tests asked for (quick.txt): those that did not run are listed')
    opts = p.parse_args(argv)
    try:
        rows = outcomes(opts.junit)
        why = None
    except (OSError, ET.ParseError) as e:
        rows, why = [], f'no JUnit XML in {opts.junit} ({e}): pytest was stopped before it wrote it'
    if opts.progress:
        try:
            with open(opts.progress, encoding='utf-8', errors='replace') as f:
                rows = merge(rows, *read_progress(f.read()))
        except OSError:
            pass  # no test started
    missing = not_run(rows, asked(opts.list)) if opts.list else []
    print('\n'.join(table(rows, missing)))
    if why:
        print(f'results.py: {why}; the tests above are from the progress file.')
    return verdict(rows)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

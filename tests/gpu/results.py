"""The GPU run's results by test name, from pytest's JUnit XML: each test's outcome and seconds,
then the tests that were asked for and never ran (a stage's time budget ran out). bash
tests/gpu/run.sh prints it last and keeps it as summary.md in the results folder, ready for
BENCHMARKS.md.

    python tests/gpu/results.py RESULTS/junit.xml [tests/gpu/quick.txt]
"""
import collections
import sys
import xml.etree.ElementTree as ET


def outcomes(junit_path):
    """-> [(node id, outcome, seconds, message)] in the order the tests ran."""
    rows = []
    for case in ET.parse(junit_path).getroot().iter('testcase'):
        path = case.get('classname', '').replace('.', '/')  # gpu.test_gpu -> gpu/test_gpu
        node = f"{path}.py::{case.get('name')}"
        outcome, message = 'passed', ''
        for tag in ('failure', 'error', 'skipped'):
            found = case.find(tag)
            if found is not None:
                outcome = {'failure': 'failed', 'error': 'error', 'skipped': 'skipped'}[tag]
                message = (found.get('message') or '').split('\n')[0][:160]
                break
        rows.append((node, outcome, float(case.get('time') or 0.0), message))
    return rows


def asked(list_path):
    """The node ids of a list like quick.txt, parametrised ones included as given."""
    with open(list_path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith('#')]


def not_run(rows, wanted):
    """The tests of `wanted` of which no case ran (a node id without [...] matches its parametrised
    cases)."""
    ran = {node for node, *_ in rows}
    return [w for w in wanted if w not in ran and not any(r.startswith(w + '[') for r in ran)]


def table(rows, missing=()):
    lines = ['| test | result | s |', '|---|---|---:|']
    for node, outcome, seconds, message in rows:
        result = f"{outcome}: {message.replace('|', '/')}" if message else outcome
        lines.append(f"| `{node.split('::', 1)[1]}` | {result} | {seconds:.1f} |")
    lines += [f"| `{node.split('::', 1)[1]}` | not run | |" for node in missing]
    counts = collections.Counter(outcome for _, outcome, _, _ in rows)
    said = [f'{n} {outcome}' for outcome, n in sorted(counts.items())]
    said += [f'{len(missing)} not run'] if missing else []
    seconds = sum(t for _, _, t, _ in rows)
    return lines + ['', f"{', '.join(said)}; {seconds:.0f} s in tests."]


def main(argv):
    try:
        rows = outcomes(argv[0])
    except (OSError, ET.ParseError) as e:
        print(f'results.py: no test results in {argv[0]} ({e}); pytest was stopped before it wrote '
              f'them.')
        return 1
    missing = not_run(rows, asked(argv[1])) if len(argv) > 1 else []
    print('\n'.join(table(rows, missing)))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

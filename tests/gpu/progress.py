"""Which test is running, written as it happens: a line when a test starts and one when it ends,
into the file named by DLOJZ_GPU_PROGRESS (run.sh sets it to <results>/progress.txt). pytest's JUnit
XML is written at the end of the session: a test stopped by a time limit is in it without a name,
and a pytest killed after its time limit writes none. This file names both, whatever stops the run;
results.py reads it beside junit.xml. tests/gpu/conftest.py takes these hooks; nothing is written
when the variable is unset.

Format: one line per event, `start<TAB>node id` or `end<TAB>node id`, each written with one os.write
(no buffer left to lose when the process is killed)."""
import os

VARIABLE = 'DLOJZ_GPU_PROGRESS'


def _write(event, nodeid):
    path = os.environ.get(VARIABLE)
    if not path:
        return
    line = f"{event}\t{nodeid.replace(chr(10), ' ')}\n".encode('utf-8', 'replace')
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def pytest_runtest_logstart(nodeid, location):
    _write('start', nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write('end', nodeid)

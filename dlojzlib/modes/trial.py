"""A trial: dlojz run as a process of its own (its own memory peak, its own compile cache) and the
summary.json it wrote. The loader doctor's trials (modes.doctor) and the tuner's (modes.tune) both
run this way."""
import subprocess

from dlojzlib.record.rundir import run_record


def run_for_summary(cmd, out):
    """A dlojz process of its own (a trial of the loader doctor or the tuner) -> (its
    out/summary.json or None, exit code, its last stderr line)."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    return run_record(out), r.returncode, (r.stderr.strip().splitlines() or ['no output'])[-1]

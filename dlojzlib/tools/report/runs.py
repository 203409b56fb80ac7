"""The run folders a report reads: summary.json, config.json, metrics.jsonl (the latest attempt's
records), their problems, and the folders found under the paths given. Each file is read through
dlojzlib.readers in the shape shapes.py declares: whatever is at its path, the run gets a value of
that shape or a note saying what is wrong with the file, never a read that blocks."""
import os
from dataclasses import dataclass, field

from dlojzlib import readers
from dlojzlib.record.log import SUMMARY_VERSION
from dlojzlib.tools.report.shapes import CONFIG, METRICS_LIMIT, RECORD, SUMMARY


class ReportError(Exception):
    """A user error: one sentence saying what is wrong and what to do."""


def dig(d, *keys):
    """d[k1][k2]... or None when a level is missing or not a dict (older or partial summaries)."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


@dataclass
class RunDir:
    path: str
    name: str
    summary: dict = None      # None: no readable summary.json (crashed, killed, still running)
    config: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # what was missing or unreadable, said in the report
    unreadable: bool = False  # summary.json is there but cannot be used (its note says why)

    @property
    def status(self):
        return (self.summary or {}).get('status') or \
            ('unreadable' if self.unreadable else 'incomplete')

    def get(self, *keys):
        return dig(self.summary, *keys)

    @property
    def world_size(self):
        return self.get('world_size') or 1

    @property
    def batch_size(self):
        return self.config.get('batch_size')


def unreadable(path, e):
    """The note on a file that is there but cannot be used."""
    why = f'it {e.why}' if isinstance(e, readers.Unreadable) else e.strerror or str(e)
    return f'{os.path.basename(path)} is unreadable: {why}'


def read_json(path, shape):
    """-> (value of `shape`, problem): problem is a note when the file is there but cannot be
    used; (None, None) when it is absent."""
    try:
        return readers.read_json(path, shape), None
    except FileNotFoundError:
        return None, None
    except (OSError, readers.Unreadable) as e:
        return None, unreadable(path, e)


def load_run(path):
    run = RunDir(os.path.abspath(path), os.path.basename(os.path.normpath(path)))
    run.summary, problem = read_json(os.path.join(path, 'summary.json'), SUMMARY)
    if problem:
        run.notes.append(problem)
        run.unreadable = True
    config, problem = read_json(os.path.join(path, 'config.json'), CONFIG)
    if problem:
        run.notes.append(problem)
    run.config = dict(dig(run.summary, 'config') or config or {})
    version = dig(run.summary, 'version')
    if run.summary is not None and isinstance(version, int) and version > SUMMARY_VERSION:
        run.notes.append(f'summary.json is version {version}, newer than this report '
                         f'({SUMMARY_VERSION}): fields it does not know are ignored')
    bad, metrics = 0, os.path.join(path, 'metrics.jsonl')
    try:
        run.records, bad = readers.read_jsonl(metrics, RECORD, METRICS_LIMIT)
    except FileNotFoundError:  # normal before the first log line
        pass
    except (OSError, readers.Unreadable) as e:
        run.notes.append(unreadable(metrics, e))
    if bad:
        run.notes.append(f'{bad} unreadable line(s) in metrics.jsonl (cut by a crash, or not a '
                         f'record dlojz writes): left out')
    run.records, repeated = latest_records(run.records)
    if repeated:
        run.notes.append(f'{repeated} record(s) of metrics.jsonl were logged again by a resumed '
                         f'run (written before dlojz trimmed them on resume): each step is counted '
                         f'once, from the resumed run')
    return run


def latest_records(records):
    """A run resumed by a dlojz older than the trimming of metrics.jsonl (record.rundir.trim_metrics) logged the
    steps after its checkpoint twice: keep the last record of each (type, global step), in order.
    -> (records, number dropped)."""
    last = {}
    for i, r in enumerate(records):
        if isinstance(r.get('global_step'), int):
            last[(r.get('type'), r['global_step'])] = i
    kept = [r for i, r in enumerate(records)
            if not isinstance(r.get('global_step'),
                              int) or last[(r.get('type'), r['global_step'])] == i]
    return kept, len(records) - len(kept)


def listdir(path):
    try:
        return os.listdir(path)
    except OSError as e:
        raise ReportError(f'cannot list {path} ({e.strerror or e}); pass a folder you can read.')


def is_run_dir(path):
    return any(os.path.isfile(os.path.join(path, f)) for f in ('summary.json', 'config.json', 'metrics.jsonl'))


def collect_runs(paths):
    """Run directories among paths; a folder that is not a run but holds runs (e.g. runs/) is expanded.
    -> (runs, skipped paths)."""
    found, skipped = [], []
    for p in paths:
        if not os.path.exists(p):
            raise ReportError(f'{p} does not exist; pass run directories written by dlojz.py '
                              f'(--output-dir).')
        if is_run_dir(p):
            found.append(p)
        elif os.path.isdir(p) and (subs := sorted(os.path.join(p, d) for d in listdir(p)
                                                  if is_run_dir(os.path.join(p, d)))):
            found.extend(subs)
        else:
            skipped.append(p)
    if not found:
        raise ReportError(f'no dlojz run directory among {" ".join(paths)}; pass folders written '
                          f'by dlojz.py --output-dir (they hold summary.json, config.json, '
                          f'metrics.jsonl).')
    runs = [load_run(p) for p in dict.fromkeys(os.path.abspath(p) for p in found)]
    names = [r.name for r in runs]
    for r in runs:  # two runs named alike in different folders: name them by parent/name
        if names.count(r.name) > 1:
            r.name = os.path.join(os.path.basename(os.path.dirname(r.path)), r.name)
    return runs, skipped

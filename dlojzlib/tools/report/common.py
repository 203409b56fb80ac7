"""What the report's views share: a run's numbers and verdict, value formats, tables, figures,
groups of runs."""
import datetime
import json
import os
import re

from dlojzlib import tables
from dlojzlib.record.checkpoint import list_checkpoints
from dlojzlib.record.summary import job_key
from dlojzlib.tools.report.runs import ReportError, dig


# Config keys that name places, not what was measured: they always differ between runs.
PATH_KEYS = {'output_dir', 'cache_dir', 'resume'}
DERIVED_KEYS = {'findlr_upper'}  # written by dlojz before --lr held the sweep's upper end: follows lr
COLORS = {'data': '#d62728', 'h2d': '#ff7f0e', 'forward': '#1f77b4', 'backward': '#2ca02c',
          'optimizer': '#9467bd', 'other': '#7f7f7f'}
GiB = 2 ** 30


def scaled(v, factor):
    """v * factor (a unit change: s -> ms, bytes -> GiB), None stays None."""
    return v * factor if v is not None else None


def last_record(run, kind):
    recs = [r for r in run.records if r.get('type') == kind]
    return recs[-1] if recs else None


def verdict(run):
    """One line: completed, or what stopped the run and at which step (from the run's recorded
    status)."""
    if run.summary is None or run.status == 'running':  # dlojz writes 'running' as each attempt starts
        last = last_record(run, 'train')
        ckpts = list_checkpoints(run.path)
        why = 'no summary.json' if run.summary is None else "summary.json still says 'running'"
        head = 'unknown: summary.json is unreadable (its note says why)' if run.unreadable else \
            f'incomplete: {why}, the run crashed, was killed or is still running'
        return (f"{head}; last logged step {last.get('global_step') if last else 'none'}; newest "
                f"checkpoint {os.path.basename(ckpts[-1]) if ckpts else 'none'}")
    status, step, error = run.status, run.get('failed_step'), run.get('error')
    if status == 'completed':
        mode = run.get('mode')
        return 'completed' + (f' ({mode} run)' if mode and mode != 'train' else '')
    what = {'nan': 'NaN loss', 'oom': 'out of memory', 'failed': 'failed', 'crashed': 'crashed',
            'interrupted': 'interrupted', 'preempted': 'preempted'}.get(status, status)
    where = f' at step {step}' if step is not None else ''
    if status == 'oom' and run.batch_size:
        where += f' with batch {run.batch_size} per process'
    return f'{what}{where}' + (f': '
                               f'{error}' if error and error != status and status != 'oom' else '')


def numbers(run):
    """The figures the comparison, sweep and scaling views share, None where the run did not record
    them."""
    t, m, e = run.get('timing') or {}, run.get('memory') or {}, run.get('energy') or {}
    start = run.get('startup') or {}
    st = t.get('stats') or {}
    load = compute = None
    if dig(st, 'data', 'mean') is not None:  # mean of data + h2d = the '>>> Loading performance' avg
        load = st['data']['mean'] + (dig(st, 'h2d', 'mean') or 0.0)
    if dig(st, 'compute', 'mean') is not None:  # the copy is in the compute span and in load: once
        compute = st['compute']['mean'] - (dig(st, 'h2d', 'mean') or 0.0)
    return {
        # means, which are sums over the steady steps: load + compute is the mean step
        'load_ms': scaled(load, 1e3), 'compute_ms': scaled(compute, 1e3),
        'step_ms': scaled(dig(st, 'step', 'median'), 1e3),
        'train_img_s': t.get('train_throughput'), 'gpu_img_s': t.get('gpu_throughput'),
        # the job's verdict comes with the job's shares (rank 0's alone could read 'compute, busy
        # 100 %' beside 'loader'), as the run's '>>> Bound by' line gives them
        'busy_pct': scaled(t.get(job_key(t, 'device_busy') or 'device_busy'), 100),
        'data_pct': scaled(t.get(job_key(t, 'data_share') or 'data_share'), 100),
        'bound': t.get('bound'),
        'host_mem_gib': scaled(m.get('host_peak_rss_bytes'), 1 / GiB),
        'gpu_mem_gib': scaled(m.get('gpu_max_allocated_bytes_any_rank') or m.get('gpu_max_allocated_bytes'), 1 / GiB),
        'j_per_img': e.get('joules_per_image_all_ranks') or e.get('joules_per_image'),
        'top1': dig(run.summary, 'val', 'top1'),
        # the time to the first step beside the steady figures, its longest phase (measure.startup)
        'startup_s': start.get('total_s'),
        'startup_phase': next(iter(start.get('phases') or {}), None),
    }


METRICS = ['load_ms', 'compute_ms', 'step_ms', 'train_img_s', 'gpu_img_s', 'busy_pct', 'data_pct',
           'bound', 'host_mem_gib', 'gpu_mem_gib', 'j_per_img', 'top1', 'startup_s',
           'startup_phase']


HIGHER_IS_BETTER = {'train_img_s', 'gpu_img_s', 'top1'}  # sorted best first: these descending, others ascending


FORMATS = {'startup_s': '.1f', 'comm_pts': '.1f', 'straggler_pts': '.1f', 'rest_pts': '.1f',
           'compute_slowed_pts': '.1f', 'loader_slowed_pts': '.1f',
           'step_ms': '.1f',
           'top1': '.4f', 'top1_before': '.4f', 'top1_after': '.4f', 'loss_before': '.4f',
           'loss_after': '.4f',
           'speedup': '.2f', 'efficiency': '.1%', 'j_per_img': '.3f', 'host_mem_gib': '.2f',
           'gpu_mem_gib': '.2f',
           'mem_gib': '.3f', 'max_diff': '.3g'}


MEASURED = ('_ms', '_img_s', '_w', '_pct', '_step')  # column suffixes of timings, rates and averages


def fmt(v, col=''):
    """A cell: measured figures rounded for reading, flag values as given (0.1 stays 0.1)."""
    if v is None:
        return '—'
    if isinstance(v, bool):
        return 'on' if v else 'off'
    if isinstance(v, float):
        if col in FORMATS:
            return format(v, FORMATS[col])
        if col.endswith(MEASURED) or not col:
            return f'{v:.1f}' if abs(v) >= 10 else f'{v:.2f}' if abs(v) >= 0.01 else f'{v:.3g}'
        return f'{v:g}'
    if isinstance(v, int) and col in ('bytes', 'calls'):
        return f'{v:,}'
    return str(v)


def md_table(columns, rows, headers=None):
    return tables.markdown(headers or columns,
                           [[fmt(row.get(c), c) for c in columns] for row in rows])


def text_table(columns, rows):
    cells = [columns] + [[fmt(row.get(c), c) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return ['  '.join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]


def shown(columns, rows):
    """Drop measured columns that no run has (e.g. GPU memory and energy on CPU runs) from the
    display."""
    return [c for c in columns if c not in METRICS or any(row.get(c) is not None for row in rows)]


def hms(seconds):
    if seconds is None:
        return '—'
    return f'{seconds:.1f} s' if seconds < 60 else str(datetime.timedelta(seconds=round(seconds)))


def gib(b):
    return f'{b / GiB:.2f} GiB' if b is not None else '—'


def plt():
    import matplotlib
    matplotlib.use('Agg')  # headless: login nodes have no display
    import matplotlib.pyplot
    return matplotlib.pyplot


def save_fig(fig, out, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=100)
    plt().close(fig)
    return name


def slug(name):
    return re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_') or 'run'


def group_runs(runs, ignore):
    """Runs whose config is equal apart from `ignore` (and paths), in first-seen order."""
    groups = {}
    for r in runs:
        if not r.config:
            continue
        key = json.dumps({k: v for k, v in r.config.items() if k not in PATH_KEYS | set(ignore)},
                         sort_keys=True,
                         default=str)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def label(run):
    c = run.config
    return (f"{c.get('arch')} {c.get('image_size')} px, amp {c.get('amp')}, channels-last "
            f"{'on' if c.get('channels_last') else 'off'}, {c.get('optimizer')}")


def guarded(title, build, problems):
    """A part that fails on odd input becomes a sentence in the report, never a traceback. A user
    error (ReportError: a bad --sort) still stops the command."""
    try:
        return build()
    except ReportError:
        raise
    except Exception as e:  # noqa: BLE001 - a report of many runs must survive one bad run
        problems.append(f'{title}: {type(e).__name__}: {e}')
        return [f'*{title} could not be built: {type(e).__name__}: {e}*', '']


def trials_sections(rep, title, key, section):
    """The view of the runs whose summary holds `key` with trials (the loader doctor's, the
    tuner's): '## title', then for each such run its '### name' and section(run, record)'s lines;
    none without."""
    lines = []
    for r in rep.runs:
        record = r.get(key)
        if record and record.get('trials'):
            lines += [f'### {r.name}', ''] + section(r, record)
    return ['## ' + title, ''] + lines if lines else []

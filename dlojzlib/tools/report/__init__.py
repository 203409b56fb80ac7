"""dlojz report: the course's analysis tools, headless — run dashboards (controle_technique), step
timelines (turbo_profiler), run comparisons (the DataLoader-trials table), batch-size sweeps
(GPU_underthehood), scaling, NCCL communication (comm_profiler), BatchNorm view, metric sync log, LR
finder and config diff.

It reads what dlojz.py writes in a run directory — summary.json, config.json, metrics.jsonl,
checkpoint-*.pt, nccl.rank<r>.log — never stdout, and writes <out>/report.md with PNG figures and
comparison.csv next to it; the comparison table is also printed.

    python dlojz_report.py runs/*                          # every section that applies to these runs
    python dlojz_report.py runs/* --sort load_ms --out trials
    python dlojz_report.py diff runs/a runs/b              # configuration differences of two runs

The package: runs.py loads run directories, common.py holds what the views share (numbers, tables,
figures), one file per view holds its computation, its figure and its Markdown together, and this
file builds the report from VIEWS, the list of views: each a function of the Report (runs, output
folder, options) returning its Markdown lines."""
import argparse
import datetime
import os
import sys
from dataclasses import dataclass, field

from dlojzlib.flags import POSITIVE_INT
from dlojzlib.tools.report.batchnorm import batchnorm_view
from dlojzlib.tools.report.common import guarded, shown, text_table, verdict
from dlojzlib.tools.report.communication import communication_view
from dlojzlib.tools.report.comparison import comparison_view
from dlojzlib.tools.report.dashboards import dashboards_view
from dlojzlib.tools.report.diff import config_diff, diff_view
from dlojzlib.tools.report.doctor import doctor_view
from dlojzlib.tools.report.lr_finder import lr_finder_view
from dlojzlib.tools.report.metric_sync import metric_sync_view
from dlojzlib.tools.report.pipeline import pipeline_view
from dlojzlib.tools.report.race import race_view
from dlojzlib.tools.report.runs import ReportError, collect_runs, is_run_dir
from dlojzlib.tools.report.scaling import scaling_view
from dlojzlib.tools.report.sweep import sweep_view
from dlojzlib.tools.report.tune import tune_view


@dataclass
class Report:
    """What every view is given: the runs, where to write and the options. A view returns its
    Markdown lines ([] when it does not apply) and may leave results here for the command line (the
    table)."""
    runs: list
    out: str
    sort: str = 'train_img_s'
    comm_steps: int = 10
    skipped: tuple = ()
    problems: list = field(default_factory=list)
    table: tuple = None       # comparison (columns, rows), printed by main
    per_config: tuple = None  # medians per repeated configuration, or None


VIEWS = [('comparison', comparison_view), ('run dashboards', dashboards_view),
         ('batch-size sweep', sweep_view), ('scaling', scaling_view),
         ('communication', communication_view), ('pipelines', pipeline_view),
         ('BatchNorm view', batchnorm_view),
         ('metric sync log', metric_sync_view), ('LR finder', lr_finder_view),
         ('loader doctor', doctor_view), ('tuning', tune_view),
         ('time to accuracy', race_view), ('diff', diff_view)]


def build_report(rep):
    """Write rep.out/report.md with its figures and CSV files, one view after the other; -> rep."""
    os.makedirs(rep.out, exist_ok=True)
    md = ['# dlojz report', '',
          f'{len(rep.runs)} run(s), generated {datetime.datetime.now():%Y-%m-%d %H:%M} by '
          f'`dlojz_report.py`.', '']
    md += [f'*Skipped (not a dlojz run directory): '
           f'{p}*' for p in rep.skipped] + ([''] if rep.skipped else [])
    for title, view in VIEWS:
        md += guarded(title, lambda view=view: view(rep), rep.problems)
    if rep.problems:
        md += ['## Problems', ''] + [f'- {p}' for p in rep.problems] + ['']
    with open(os.path.join(rep.out, 'report.md'), 'w') as f:
        f.write('\n'.join(md))
    return rep


# --------------------------------------------------------------------------------------- command line

def get_args_parser():
    p = argparse.ArgumentParser(description='Report on dlojz run directories: Markdown + PNG '
                                            'figures + CSV.',
                                epilog='python dlojz_report.py diff RUN_A RUN_B prints their '
                                       'configuration differences.')
    p.add_argument('runs', nargs='+',
                   help='run directories written by dlojz.py (--output-dir), or folders holding '
                                           'them (e.g. runs/)')
    p.add_argument('--out', default='report',
                   help='folder for report.md, comparison.csv and the figures (default: '
                                                   './report)')
    p.add_argument('--sort', default='train_img_s',
                   help='comparison column to sort by, best first (throughputs and top1 '
                                                         'descending, times and memory ascending); '
                                                         'default train_img_s')
    p.add_argument('--comm-steps', type=POSITIVE_INT, default=10,
                   help='training steps shown in the communication figure')
    return p


def diff_main(argv):
    p = argparse.ArgumentParser(prog='dlojz_report.py diff',
                                description='Configuration differences of two runs.')
    p.add_argument('a')
    p.add_argument('b')
    args = p.parse_args(argv)
    runs, _ = collect_runs([args.a, args.b])
    if len(runs) != 2:
        raise ReportError(f'diff compares two run directories, got {len(runs)}; pass exactly two.')
    diff = config_diff(*runs)
    print('\n'.join(text_table(['section', 'key', runs[0].name, runs[1].name],
                               [dict(zip(('section', 'key', runs[0].name, runs[1].name),
                                         d)) for d in diff]))
          if diff else 'same configuration and provenance')


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['diff'] and not is_run_dir('diff'):
        return diff_main(argv[1:])
    args = get_args_parser().parse_args(argv)
    runs, skipped = collect_runs(args.runs)
    try:  # a folder that cannot be created or written, or --out naming a file
        rep = build_report(Report(runs, args.out, args.sort, args.comm_steps, skipped))
    except OSError as e:
        raise ReportError(f'cannot write the report into {args.out} ({e.strerror or e}); pass a '
                          f'writable --out.')
    if rep.table:
        print('\n'.join(text_table(shown(*rep.table), rep.table[1])))
    if rep.per_config:
        print('\nMedian per configuration:')
        print('\n'.join(text_table(shown(*rep.per_config), rep.per_config[1])))
    for r in runs:
        if r.status != 'completed':
            print(f'{r.name}: {verdict(r)}')
    for p in skipped:
        print(f'skipped {p}: not a dlojz run directory')
    for p in rep.problems:
        print(f'problem: {p}', file=sys.stderr)
    print(f'Report written to {os.path.join(args.out, "report.md")}')


def cli(argv=None):
    try:
        main(argv)
    except ReportError as e:
        print(f'dlojz_report: error: {e}', file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse's usage errors (already printed) and --help, as a return code
        return e.code
    return 0


if __name__ == '__main__':
    sys.exit(cli())

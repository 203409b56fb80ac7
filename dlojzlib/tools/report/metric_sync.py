"""The metric sync log: what each rank's meters held at each sync."""
from dlojzlib.tools.report.common import md_table


def metric_sync_rows(run):
    rows = []
    for rec in run.records:
        if rec.get('type') != 'metric_sync':
            continue
        for r in rec.get('ranks') or []:
            before, after = r.get('before') or {}, r.get('after') or {}
            rows.append({'step': rec.get('global_step'), 'rank': r.get('rank'),
                         'loss_before': before.get('loss'), 'loss_after': after.get('loss'),
                         'top1_before': before.get('top1'), 'top1_after': after.get('top1')})
    return rows


def metric_sync_view(rep):
    """metric_compute_log: per-rank values before and after the sync."""
    runs = rep.runs
    lines = []
    for r in runs:
        rows_s = metric_sync_rows(r)
        if rows_s:
            steps = {}
            for row in rows_s:
                steps.setdefault(row['step'], set()).add((row['loss_after'], row['top1_after']))
            agree = all(len(v) == 1 for v in steps.values())
            lines += [f'### {r.name}', '', f"After compute() every rank holds the same values: "
                      f"{'yes' if agree else '**no**'} ({len(steps)} syncs).", '']
            lines += md_table(['step', 'rank', 'loss_before', 'loss_after', 'top1_before',
                               'top1_after'],
                              rows_s) + ['']
    return ['## Metric sync log', '', 'Per-rank training metrics before (local) and after (synced) '
            'the meters\' compute(), from `--metric-sync-log`.', ''] + lines if lines else []

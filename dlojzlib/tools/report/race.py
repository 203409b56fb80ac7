"""The time-to-accuracy view: validation top-1 against time and images."""
import os

from dlojzlib import tables
from dlojzlib.tools.report.common import md_table, plt, save_fig
from dlojzlib.tools.report.runs import dig


def accuracy_curve(run, kind):
    """[(wall s, images seen, top-1)] of the run's validations ('val' raw, 'val_ema' EMA) that carry
    them."""
    return [(r['wall_s'], r['train_images'], r['top1']) for r in run.records
            if r.get('type') == kind and None not in (r.get('wall_s'), r.get('train_images'),
                                                     r.get('top1'))]


def plot_race(runs, targets, out):
    """The race's figure: validation top-1 against wall time and against images seen, one colour per
    run, the EMA dashed, the --target-top1 lines dotted. A run with one validation (a --test run) is
    one point: it gets a large marker and its top-1 written beside it, and both axes start at 0, so
    it does not vanish in a corner of an empty figure."""
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(11, 4), sharey=True)
    longest = max(w for r in runs for w, _, _ in accuracy_curve(r, 'val'))
    unit, unit_name = (60, 'minutes') if longest > 600 else (1, 's')
    for i, r in enumerate(runs):
        color = f'C{i % 10}'
        for kind, style in (('val', '-'), ('val_ema', '--')):
            pts = accuracy_curve(r, kind)
            if not pts:
                continue
            name = r.name + (' (EMA)' if kind == 'val_ema' else '')
            size = 7 if len(pts) <= 3 else 3  # few validations: the markers are the figure
            for ax, xs in ((axes[0], [w / unit for w, _, _ in pts]), (axes[1], [n for _, n, _ in pts])):
                ax.plot(xs, [t for _, _, t in pts], style, color=color, marker='o', markersize=size,
                        label=name if ax is axes[0] else None)
                if len(pts) == 1:
                    ax.annotate(f'{pts[0][2]:.3f}', (xs[0], pts[0][2]), textcoords='offset points', xytext=(6, 4),
                                fontsize=7, color=color)
    for ax, xlabel in zip(axes, (f'wall time since the start, {unit_name}', 'training images seen')):
        for t in targets:
            ax.axhline(t, color='grey', linestyle=':', linewidth=1)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('validation top-1')
    axes[0].legend(fontsize=7)
    fig.suptitle('Time to accuracy')
    return save_fig(fig, out, 'time-to-accuracy.png')


def race_view(rep):
    """Validation top-1 against wall time and images seen for every run that validated, and when
    each reached its --target-top1 (summary.json['time_to_accuracy'])."""
    runs = [r for r in rep.runs if accuracy_curve(r, 'val')]
    if not runs:
        return []
    rows, targets = [], set()
    for r in runs:
        tta = dig(r.summary, 'time_to_accuracy') or {}
        if tta.get('target_top1') is not None:
            targets.add(tta['target_top1'])
        row = {'run': r.name, 'target_top1': tta.get('target_top1'),
               'best_top1': max(t for *_, t in accuracy_curve(r, 'val'))}
        for kind in ('raw', 'ema'):
            hit = tta.get(kind) or {}
            row[f'{kind}_wall_s'], row[f'{kind}_epoch'], row[f'{kind}_images'] = (
                hit.get('wall_s'), hit.get('epoch'), hit.get('train_images'))
        rows.append(row)
    tables.write_csv(os.path.join(rep.out, 'time-to-accuracy.csv'), list(rows[0]), rows)
    return ['## Time to accuracy', '', 'When validation top-1 first reached `--target-top1` (raw weights and EMA; '
            'empty: not reached or no target).', ''] + md_table(list(rows[0]), rows) + [
        '', f'![time to accuracy]({plot_race(runs, sorted(targets), rep.out)})', '']

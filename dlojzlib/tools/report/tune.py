"""The tuning view (--tune): its trials, throughput against memory."""
from dlojzlib.tools.report.common import GiB, md_table, plt, save_fig, slug, trials_sections


def plot_tune(run, trials, out):
    """Throughput and memory against the batch per device, one line per configuration (precision,
    channels-last, compile): where a line flattens, a larger batch buys nothing."""
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(11, 4))
    configs = {}
    for t in trials:
        if t['status'] == 'completed' and t['images_per_s'] is not None:
            key = f"{t['amp']}, {'NHWC' if t['channels_last'] else 'NCHW'}, {'compiled' if t['compile'] else 'eager'}"
            configs.setdefault(key, []).append(t)
    for i, (key, ts) in enumerate(sorted(configs.items())):
        ts = sorted(ts, key=lambda t: t['batch'])
        b = [t['batch'] for t in ts]
        a1.plot(b, [t['images_per_s'] for t in ts], 'o-', color=f'C{i % 10}', label=key)
        a2.plot(b, [(t['memory_bytes'] or 0) / GiB for t in ts], 'o-', color=f'C{i % 10}',
                label=key)
    for ax, label in ((a1, 'images/second'), (a2, 'memory peak, GiB')):
        ax.set_xscale('log', base=2)
        ax.set_xlabel('batch per device')
        ax.set_ylabel(label)
    a1.legend(fontsize=7)
    fig.suptitle(f'Tuning: {run.name}')
    return save_fig(fig, out, f'tune-{slug(run.name)}.png')


def tune_view(rep):
    """The tuner's trials (--tune): its table, the recommended command, the scaling forecast, a
    figure."""
    def section(r, tune):
        rows = [{'batch': t['batch'], 'amp': t['amp'], 'channels_last': t['channels_last'],
                 'compile': t['compile'],
                 'img_s': t['images_per_s'], 'step_ms': t['step_ms'],
                 'memory_gib': (t['memory_bytes'] or 0) / GiB if t['memory_bytes'] is not None else None,
                 'bound': t['bound'], 'status': t['status']} for t in tune['trials']]
        lines = md_table(list(rows[0]), rows) + ['']
        rec = tune.get('recommended')
        if rec:
            lines += [f"Recommended ({rec['images_per_s']:.1f} img/s): `{rec['command']}`; "
                      f"{rec['lr_rule']}.", '']
        if tune.get('skipped'):
            lines += [f"Skipped for the time budget: {', '.join(tune['skipped'])}.", '']
        if tune.get('forecast'):
            lines += ['Scaling forecast (docs/scaling.md: an upper bound):', '']
            lines += md_table(['gpus', 'nodes', 'images_per_s', 'efficiency'],
                              tune['forecast']) + ['']
        return lines + [f"![tuning]({plot_tune(r, tune['trials'], rep.out)})", '']
    return trials_sections(rep, 'Tuning', 'tune', section)

"""The loader doctor view (--tune-loader): its trials against the compute ceiling."""
from dlojzlib.tools.report.common import (COLORS, fmt, md_table, plt, save_fig, slug,
                                          trials_sections)


def plot_doctor(run, tune, out):
    """One bar per loader trial (images/second), the compute ceiling as a line: bars short of it are
    settings that would leave the model waiting."""
    trials, ceiling = tune['trials'], tune['ceiling'].get('images_per_second')  # may be absent
    ceiling = ceiling if ceiling is not None else float('inf')  # unmeasured: no bar is red
    p = plt()
    fig, ax = p.subplots(figsize=(8, 1.2 + 0.4 * len(trials)))
    y = range(len(trials))[::-1]
    ips = [t['images_per_second'] for t in trials]
    colors = [COLORS['data'] if v < ceiling else COLORS['forward'] for v in ips]
    ax.barh(y, ips, color=colors)
    if ceiling < float('inf'):
        ax.axvline(ceiling, color='black', linestyle='--',
                   label=f'compute ceiling (--fake-data) {ceiling:.0f} img/s')
    labels = [f"{t['num_workers']} workers, prefetch {t['prefetch_factor'] or '-'}, {t['decode']}"
              + ('' if t['pin_memory'] is None else f", pin {'on' if t['pin_memory'] else 'off'}") for t in trials]
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel('loader images/second (red: below the ceiling)')
    ax.set_title(f'Loader doctor: {run.name}', pad=22)
    ax.legend(fontsize=7, loc='lower center', bbox_to_anchor=(0.5, 1.0), frameon=False)
    return save_fig(fig, out, f'doctor-{slug(run.name)}.png')


def doctor_view(rep):
    """The loader doctor's trials (--tune-loader): the course's DataLoader-trials table and a
    figure."""
    def section(r, tune):
        v = tune['verdict']
        rows = [{'workers': t['num_workers'], 'pin': t['pin_memory'], 'prefetch': t['prefetch_factor'],
                 'decode': t['decode'], 'img_s': t['images_per_second'],
                 'img_s_per_worker': t['images_per_second_per_worker'], 'load_s': t['wait_mean_s'],
                 'first_s': t['first_batch_s'], 'host_mem_gib': t['host_peak_bytes'] / 2**30}
                for t in tune['trials']]
        return [f"Compute ceiling {fmt(v['ceiling_images_per_second'])} img/s; best loader "
                f"setting {v['best']['images_per_second']:.1f} img/s: **{v.get('bound')}-bound**.",
                ''] + \
            md_table(list(rows[0]), rows) + ['', f'![loader doctor]({plot_doctor(r, tune, rep.out)})', '']
    return trials_sections(rep, 'Loader doctor', 'tune_loader', section)

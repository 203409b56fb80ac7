"""The LR finder view: the sweep's curve, smoothed, and its suggested learning rate."""
import math

from dlojzlib.recipe import FINDLR_MIN_STEPS, centered_mean, diverged_at, suggest_lr
from dlojzlib.tools.report.common import plt, save_fig, slug


def lr_suggestion(lrs, losses):
    """-> (smoothed curve, cut, suggested lr or None, why): dlojz's own rule (recipe.suggest_lr, the
    steepest descent of the smoothed loss), so the report says what the console and summary.json
    said. The curve is cut where the sweep counts as diverged; `smoothed` is the centered mean the
    suggestion follows."""
    cut = diverged_at(losses)
    suggested, why = suggest_lr(lrs, losses)
    return centered_mean(losses[:cut], max(1, cut // 20)), cut, suggested, why


def lr_plot_ylim(losses, smoothed):
    """The loss axis of the LR finder plot: the smoothed curve with a margin; raw spikes above it
    are clipped (one loss of 120 squashed the descent into a flat line)."""
    lo = min([v for v in losses if math.isfinite(v)] + list(smoothed))
    hi = max(smoothed)
    margin = 0.15 * (hi - lo) or 0.1 * abs(hi) or 1.0
    return lo - margin / 3, hi + margin


def plot_lr(run, lrs, losses, sm, cut, suggested, out):
    p = plt()
    fig, ax = p.subplots(figsize=(7, 3.5))
    ax.plot(lrs[:cut], losses[:cut], color='#9ecae1', lw=1, label='loss')
    ax.plot(lrs[:cut], sm, color='navy', label='smoothed (centered mean)')
    if suggested:
        ax.axvline(suggested, color='#d62728', ls='--',
                   label=f'suggested lr {suggested:.3g} (steepest descent)')
    ax.set_ylim(*lr_plot_ylim(losses[:cut], sm))
    ax.set_xscale('log')
    ax.set_xlabel('learning rate')
    ax.set_ylabel('training loss')
    ax.set_title(f'{run.name}: LR range test')
    ax.legend(fontsize=7)
    return save_fig(fig, out, f'lrfind-{slug(run.name)}.png')


def lr_finder_view(rep):
    """lrfind_plot: smoothed loss vs LR and a suggestion."""
    runs, out = rep.runs, rep.out
    lines = []
    for r in runs:
        fl = r.get('findlr')
        if not fl or not fl.get('lr'):
            continue
        # a sweep's lr and loss are logged together: a summary with more of one is cut to the other
        n = min(len(fl['lr']), len(fl.get('loss') or []))
        if not n:
            continue
        lrs, losses = fl['lr'][:n], [v if v is not None else float('nan') for v in fl['loss'][:n]]
        sm, cut, suggested, why = lr_suggestion(lrs, losses)
        lines += [f'### {r.name}', '', f"{len(lrs)} steps from lr {lrs[0]:.3g} to {lrs[-1]:.3g}; " +
                  (f"**suggested lr {suggested:.3g}** "
                   f"({why})." if suggested else f"no suggestion: {why}."), '']
        if len(lrs) < FINDLR_MIN_STEPS:
            lines += [f'A sweep of fewer than {FINDLR_MIN_STEPS} steps places the suggestion '
                      f'coarsely; sweep longer (--test-nsteps).', '']
        if fl.get('stopped'):  # dlojz stops a sweep when the loss diverges
            lines += [f"The sweep ended: {fl['stopped']}.", '']
        if cut:
            lines += [f'![LR finder]({plot_lr(r, lrs, losses, sm, cut, suggested, out)})', '']
    return ['## LR finder', ''] + lines if lines else []

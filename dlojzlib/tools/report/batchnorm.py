"""The BatchNorm view: each layer's statistics in the runs' checkpoints, side by side."""
import os

from dlojzlib import tables
from dlojzlib.errors import UsageError
from dlojzlib.record.checkpoint import list_checkpoints, load_checkpoint, strip_prefixes
from dlojzlib.tools.report.common import md_table, plt, save_fig


BN_STATS = ('running_mean', 'running_var', 'weight', 'bias')


def bn_layers(state_dict):
    """Every BatchNorm layer (one with a running_mean: downsample.1 included, which the course's
    'bn' name filter missed) -> {layer: {stat: mean of the tensor}}, in state-dict order."""
    out = {}
    for k in state_dict:
        if k.endswith('.running_mean'):
            layer = k[:-len('.running_mean')]
            out[layer] = {s: float(state_dict[f'{layer}.{s}'].float().mean()) for s in BN_STATS
                          if f'{layer}.{s}' in state_dict}
    return out


def checkpoint_weights(path):
    """A dlojz checkpoint (dict with 'model') or a bare state dict (the course's) -> state dict,
    unprefixed. Checkpoints are unpickled in full: read only your own."""
    state = load_checkpoint(path)
    sd = state.get('model', state) if isinstance(state, dict) else {}
    return strip_prefixes(sd)


def bn_view(runs):
    """-> {'layers': [...], 'runs': {name: {layer: stats}}, 'checkpoints': {name: path}} or None."""
    per_run, paths, notes = {}, {}, []
    for r in runs:
        ckpts = list_checkpoints(r.path)
        if not ckpts:
            continue
        try:
            per_run[r.name] = bn_layers(checkpoint_weights(ckpts[-1]))
            paths[r.name] = os.path.basename(ckpts[-1])
        except UsageError as e:
            notes.append(f'{r.name}: {e}')
    if not per_run:
        return None if not notes else {'layers': [], 'runs': {}, 'checkpoints': {}, 'notes': notes}
    layers = list(dict.fromkeys(l for v in per_run.values() for l in v))
    return {'layers': layers, 'runs': per_run, 'checkpoints': paths, 'notes': notes}


def plot_bn(bn, out):
    p = plt()
    fig, axes = p.subplots(2, 2, figsize=(13, 7))
    x = range(len(bn['layers']))
    for ax, stat in zip(axes.flat, BN_STATS):
        for name, layers in bn['runs'].items():
            ax.plot(x, [layers.get(l, {}).get(stat, float('nan')) for l in bn['layers']], '-o',
                    ms=3, label=name)
        ax.set_title(f'mean of {stat}')
        ax.set_xticks(list(x), bn['layers'], rotation=90, fontsize=5)
    axes.flat[0].legend(fontsize=7)
    return save_fig(fig, out, 'batchnorm.png')


def batchnorm_view(rep):
    """BatchNorm_view: the newest checkpoint of each run."""
    runs, out = rep.runs, rep.out
    bn = bn_view(runs)
    if bn is None:
        return []
    lines = ['## BatchNorm view', '']
    lines += [f'*{n}*' for n in bn['notes']]
    if not bn['runs']:
        return lines + ['']
    sources = ', '.join(f'{k}: {v}' for k, v in bn['checkpoints'].items())
    lines += [f"Mean of each BatchNorm tensor, {len(bn['layers'])} layers (downsample included), "
              f"from {sources}.", '']
    if len(bn['runs']) > 1:
        rows_bn = []
        for stat in BN_STATS:
            spread = [(max(v[l][stat] for v in bn['runs'].values() if l in v and stat in v[l]) -
                       min(v[l][stat] for v in bn['runs'].values() if l in v and stat in v[l]), l)
                      for l in bn['layers'] if all(l in v and stat in v[l] for v in bn['runs'].values())]
            d, layer = max(spread) if spread else (None, None)
            rows_bn.append({'stat': stat, 'max_diff': d, 'layer': layer})
        lines += md_table(['stat', 'max_diff', 'layer'], rows_bn,
                          ['statistic', 'largest difference between runs', 'at layer']) + ['']
    tables.write_csv(os.path.join(out, 'batchnorm.csv'), ['run', 'layer'] + list(BN_STATS),
                     [[name, l] + [v.get(s) for s in BN_STATS]
                      for name, layers in bn['runs'].items() for l, v in layers.items()])
    return lines + ['Per layer values: [batchnorm.csv](batchnorm.csv).', '',
                    f'![BatchNorm]({plot_bn(bn, out)})',
                    '']

"""The configuration diff of two runs."""
from dlojzlib.tools.report.common import md_table


def config_diff(a, b):
    """-> [(section, key, value in a, value in b)] for config and provenance entries that differ."""
    out = []
    for section, da, db in (('config', a.config, b.config),
                            ('provenance', a.get('provenance') or {}, b.get('provenance') or {})):
        for k in sorted(set(da) | set(db)):
            if k in ('output_dir', 'time') or da.get(k) == db.get(k):
                continue
            out.append((section, k, da.get(k, '—'), db.get(k, '—')))
    if a.world_size != b.world_size:
        out.append(('run', 'world_size', a.world_size, b.world_size))
    return out


def diff_view(rep):
    if len(rep.runs) != 2:
        return []
    a, b = rep.runs
    return ['## Diff', '', f'`{a.name}` vs `{b.name}`:', ''] + md_table(
        ['section', 'key', 'a', 'b'],
        [dict(zip(('section', 'key', 'a', 'b'), d)) for d in config_diff(a, b)],
        ['', 'key', a.name, b.name]) + ['']

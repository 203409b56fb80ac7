"""The NCCL communication view (the course's comm_profiler): the collectives of nccl.rank<r>.log,
read through dlojzlib.readers (a FIFO or a folder in a log's place is a note, never a read that
blocks); a line NCCL did not write is not a collective."""
import io
import os
import re
import statistics

from dlojzlib import readers
from dlojzlib.tools.report.runs import unreadable as unreadable_note
from dlojzlib.tools.report.common import md_table, plt, save_fig, slug


# ncclDataType_t (nccl.h): value -> (name, bytes per element).
NCCL_DTYPES = {0: ('int8', 1), 1: ('uint8', 1), 2: ('int32', 4), 3: ('uint32', 4), 4: ('int64', 8), 5: ('uint64', 8),
               6: ('float16', 2), 7: ('float32', 4), 8: ('float64', 8), 9: ('bfloat16', 2), 10: ('float8e4m3', 1),
               11: ('float8e5m2', 1)}


# "host:pid:tid [0] NCCL INFO AllReduce: opCount 1b sendbuff 0x.. recvbuff 0x.. count 237184 datatype 7 op 0
#  root 0 comm 0x7f0c741162f0 [nranks=2] stream 0x.."  (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL)
# Numbers as NCCL writes them: the opCount in hexadecimal, none longer than a 64-bit integer.
COLL_RE = re.compile(r'\[(\d{1,9})\] NCCL INFO (\w+): opCount ([0-9a-fA-F]{1,16}) '
                     r'.*?\bcount (\d{1,19}) datatype (\d{1,4})(?:.*?\bcomm (\S+))?'
                     r'(?:.*?\[nranks=(\d{1,9})\])?')


# "host:pid:tid [0] NCCL INFO comm 0x55d6 rank 3 nranks 4 cudaDev 0 busId 7000 commId 0x.. - Init
# COMPLETE"
INIT_RE = re.compile(r'NCCL INFO comm (\S+) rank (\d{1,9}) nranks (\d{1,9}).*Init COMPLETE')


# dlojz's markers (--nccl-debug): "Train step k - rank r" before step k (0: initialisation),
# "Validation - rank r".
MARK_RE = re.compile(r'(?:Train step (\d{1,15})|(Validation)) - rank (\d{1,9})\s*$')


def parse_nccl(lines, file_rank=None):
    """NCCL collective lines -> list of ops, each tagged with the phase ('init', 'step k', 'valid')
    its rank was in. The rank of an op is its communicator's global rank (Init COMPLETE lines), else
    file_rank."""
    comm_rank, phase, ops = {}, {}, []
    for line in lines:
        if (m := MARK_RE.search(line)):
            step, valid, rank = m.groups()
            phase[int(rank)] = 'valid' if valid else 'init' if step == '0' else f'step {int(step)}'
        elif (m := INIT_RE.search(line)):
            comm_rank[m.group(1)] = int(m.group(2))
        elif (m := COLL_RE.search(line)):
            local, op, opcount, count, dtype, comm, nranks = m.groups()
            rank = comm_rank.get(comm, file_rank if file_rank is not None else int(local))
            name, size = NCCL_DTYPES.get(int(dtype), (f'type {dtype}', None))
            ops.append({'rank': rank, 'phase': phase.get(rank, 'init'), 'op': op, 'opcount': int(opcount, 16),
                        'count': int(count), 'dtype': name,
                        # bytes handed to NCCL per rank (an AllGather receives nranks times this)
                        'bytes': int(count) * size if size else None,
                        'nranks': int(nranks) if nranks else None})
    return ops


PHASE_ORDER = {'init': 0, 'train': 1, 'valid': 2}


def phase_kind(phase):
    return 'train' if phase.startswith('step') else phase


def comm_view(run, max_steps=10):
    """The run's nccl.rank<r>.log files -> tables of collectives by phase and type, or None without
    logs."""
    logs = sorted((int(m.group(1)), os.path.join(run.path, n)) for n in os.listdir(run.path)
                  if (m := re.fullmatch(r'nccl\.rank(\d+)\.log', n)))
    if not logs:
        return None
    ops, unreadable = [], []
    for rank, path in logs:
        try:
            with io.TextIOWrapper(readers.open_file(path), errors='replace') as f:
                ops.extend(parse_nccl(f, rank))
        except (OSError, readers.Unreadable) as e:
            unreadable.append(unreadable_note(path, e))
    if not ops:
        return {'ops': [], 'logs': len(logs), 'unreadable': unreadable}
    ranks = sorted({o['rank'] for o in ops})
    r0 = [o for o in ops if o['rank'] == ranks[0]]
    steps = sorted({int(o['phase'].split()[1]) for o in r0 if o['phase'].startswith('step')})
    table = {}
    for o in r0:
        row = table.setdefault((phase_kind(o['phase']), o['op']), {'calls': 0, 'bytes': 0})
        row['calls'] += 1
        row['bytes'] += o['bytes'] or 0
    per_rank = {r: (sum(1 for o in ops if o['rank'] == r), sum(o['bytes'] or 0 for o in ops if o['rank'] == r))
                for r in ranks}
    allreduce = dict.fromkeys(steps, 0)  # one pass: a --nccl-debug log of a long run has many ops
    for o in r0:
        if o['op'] == 'AllReduce' and o['phase'].startswith('step'):
            allreduce[int(o['phase'].split()[1])] += o['bytes'] or 0
    return {'ops': ops, 'logs': len(logs), 'unreadable': unreadable,
            'ranks': ranks, 'steps': steps, 'table': table, 'per_rank': per_rank,
            'consistent': len(set(per_rank.values())) == 1, 'shown_steps': steps[:max_steps],
            'allreduce_per_step': statistics.median(allreduce.values()) if allreduce else None,
            'estimate': run.get('communication', 'gradient_bytes_per_step'),
            'unknown_dtypes': sorted({o['dtype'] for o in ops if o['bytes'] is None})}


ZOOM_BYTES = 64 * 1024  # below this an op is "small": metric syncs, BN buffer broadcasts, NaN guards


def plot_comm(run, c, out):
    p = plt()
    r0 = [o for o in c['ops'] if o['rank'] == c['ranks'][0]]
    phases = ['init'] + [f'step {s}' for s in c['shown_steps']] + ['valid']
    types = sorted({o['op'] for o in r0})
    cmap = p.get_cmap('tab10')
    fig, (a1, a2) = p.subplots(2, 1, figsize=(12, 6.5))
    bottom = [0.0] * len(phases)
    for j, t in enumerate(types):
        vals = [sum(o['bytes'] or 0 for o in r0 if o['phase'] == ph and o['op'] == t) for ph in phases]
        a1.bar(phases, vals, bottom=bottom, color=cmap(j % 10), label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a1.set_yscale('symlog', linthresh=1)
    a1.set_ylim(bottom=0)
    a1.set_ylabel(f'bytes (rank {c["ranks"][0]})')
    a1.set_title(f'{run.name}: NCCL collectives per phase, total {sum(o["bytes"] or 0 for o in r0):,} bytes')
    a1.legend(fontsize=7)
    a1.tick_params(axis='x', labelsize=7, rotation=45)
    small = [o for o in sorted(r0, key=lambda o: o['opcount']) if (o['bytes'] or 0) < ZOOM_BYTES and
             (o['phase'] in phases)]
    a2.bar(range(len(small)), [o['bytes'] or 0 for o in small], color=[cmap(types.index(o['op']) % 10) for o in small])
    a2.set_xticks(range(len(small)), [o['phase'] for o in small], fontsize=6, rotation=90)
    a2.set_yscale('symlog', linthresh=1)  # 4-byte metric syncs next to kilobyte buffers
    a2.set_ylim(bottom=0)
    a2.set_ylabel('bytes')
    a2.set_title(f'zoom: the {len(small)} ops under {ZOOM_BYTES // 1024} KiB, in order (colour = type)')
    return save_fig(fig, out, f'comm-{slug(run.name)}.png')


def communication_view(rep):
    """comm_profiler: NCCL collectives from the nccl.rank<r>.log files."""
    runs, out, comm_steps = rep.runs, rep.out, rep.comm_steps
    lines = []
    for r in runs:
        c = comm_view(r, comm_steps)
        if c is None:
            continue
        lines += [f'### {r.name}', ''] + [f'*{u}.*' for u in c['unreadable']]
        if not c['ops']:
            lines += [f"{c['logs']} nccl.rank*.log file(s) but no NCCL collective line: the run used gloo "
                      f"(CPU), or NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=COLL was not in effect.", '']
            continue
        ranks, n_steps = c['ranks'], len(c['steps'])
        table = [{'phase': k, 'op': op, 'calls': v['calls'], 'bytes': v['bytes'],
                  'calls_per_step': v['calls'] / n_steps if k == 'train' and n_steps else None,
                  'bytes_per_step': v['bytes'] / n_steps if k == 'train' and n_steps else None}
                 for (k, op), v in sorted(c['table'].items(), key=lambda kv: (PHASE_ORDER.get(kv[0][0], 3), kv[0][1]))]
        lines += [f"Rank {ranks[0]}, {n_steps} training steps; bytes = count × datatype size as handed to NCCL "
                  f"(an AllGather receives nranks times this).", '']
        lines += md_table(['phase', 'op', 'calls', 'bytes', 'calls_per_step', 'bytes_per_step'], table) + ['']
        per_rank = ', '.join(f'rank {k} {n} ops / {b:,} B' for k, (n, b) in c['per_rank'].items())
        lines += [('All ranks issued the same collectives: ' if c['consistent'] else
                   '**Ranks differ** (a rank running other collectives hangs the job): ') + per_rank, '']
        if c['allreduce_per_step'] is not None and c['estimate']:
            lines += [f"Gradient AllReduce per step: {c['allreduce_per_step']:,.0f} B measured (median) vs "
                      f"{c['estimate']:,} B expected (4 B per trainable parameter).", '']
        if c['unknown_dtypes']:
            lines += [f"Unknown NCCL datatypes, bytes not counted: {', '.join(c['unknown_dtypes'])}.", '']
        lines += [f'![communication]({plot_comm(r, c, out)})', '']
    return ['## Communication (NCCL)', ''] + lines if lines else []

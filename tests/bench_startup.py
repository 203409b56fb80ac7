"""Time to the first step and metadata operations per job at 1..16 ranks, on the emulated shared
file system (tests/fsemu.py), for two checkouts side by side (before/after a change); BENCHMARKS.md
has its table. Not a test: a measurement, minutes long. One JSON line per job on stdout.

    git worktree add /tmp/before <rev>
    python tests/bench_startup.py --before /tmp/before --after . --latency 0.0004 \
        --ranks 1 2 4 8 16 --work /tmp/bench

The tree: 1 000 class folders in train/ and val/ (ImageNet's folders, 2 train and 1 val image each:
the listing's operations, not the files' reading, are what grows with the ranks). Each rank count
runs the "before" checkout once, then the "after" one twice on a new cache folder: its first job
lists, its second reuses the kept index."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsemu  # noqa: E402

FLAGS = ['--arch', 'resnet18', '--image-size', '32', '--val-resize', '36', '--val-image-size', '32',
         '-b', '2', '--val-batch-size', '2', '--num-workers', '0', '--wandb', 'off',
         '--test-nsteps', '1']


def job(mount, root, n, out, cache):
    mount.reset()
    t = time.time()
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(n),
           '--master_port', str(29000 + n), os.path.join(root, 'dlojz.py'), *FLAGS,
           '--data-dir', mount.mountpoint, '--cache-dir', cache, '--output-dir', out]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    wall, counts = time.time() - t, mount.counts()
    s = json.load(open(os.path.join(out, 'summary.json'))) if p.returncode == 0 else {}
    start = s.get('startup') or {}
    phases = start.get('phases') or {}
    return {'rc': p.returncode, 'wall_s': round(wall, 1), 'readdir': counts.get('readdir', 0),
            'getattr': counts.get('getattr', 0), 'ops': sum(counts.values()),
            'first_step_s': start.get('total_s'), 'index_s': phases.get('dataset_index'),
            'imports_s': phases.get('imports'), 'err': p.stderr[-300:] if p.returncode else ''}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--before', required=True), p.add_argument('--after', required=True)
    p.add_argument('--latency', type=float, default=0.0004, help='seconds per metadata operation')
    p.add_argument('--ranks', type=int, nargs='+', default=[1, 2, 4, 8, 16])
    p.add_argument('--work', default='/tmp/bench')
    a = p.parse_args()
    src = os.path.join(a.work, 'tree')
    if not os.path.isdir(src):
        fsemu.make_tree(src, classes=1000, train_per_class=2, val_per_class=1)
        for d, _, _ in os.walk(src):  # copied long ago: outside the index's racy window
            os.utime(d, (1_600_000_000,) * 2)
    mnt = tempfile.mkdtemp(prefix='mnt-', dir=a.work)
    with fsemu.mounted(src, mnt, latency=a.latency) as mount:
        for n in a.ranks:
            for label, root, jobs in (('before', a.before, ['first']),
                                      ('after', a.after, ['first', 'second'])):
                cache = tempfile.mkdtemp(prefix=f'cache-{label}{n}-', dir=a.work)
                for which in jobs:
                    out = tempfile.mkdtemp(prefix=f'{label}{n}-', dir=a.work)
                    row = job(mount, root, n, out, cache)
                    print(json.dumps({'ranks': n, 'code': label, 'job': which, **row}), flush=True)


if __name__ == '__main__':
    main()

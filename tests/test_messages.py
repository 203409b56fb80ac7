"""What a person reads: the steps actually run when --test-nsteps asks for more than the epochs hold, a
warning on single-class data, the hint for ImageNet's flat val/ folder, a short config line, and on a CPU
the compute throughput is not called "GPU throughput" (the course's tools do not read that line).

Run: python -m pytest -q tests/test_messages.py
"""
import re

import numpy as np
from PIL import Image

from conftest import TINY
import dlojz
from dlojzlib import flags
from dlojzlib import host


def jpegs(folder, n):
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.full((40, 40, 3), 40 * i % 255, np.uint8)).save(folder / f'img{i}.JPEG')


def run(tmp_path, *flags):
    return dlojz.cli([*TINY, '--output-dir', str(tmp_path / 'run'), *map(str, flags)])


def test_steps_run_and_short_config(tmp_path, cache_dir, capsys):
    assert run(tmp_path, '--cache-dir', cache_dir, '--test-nsteps', 200) == 0
    out = capsys.readouterr().out
    assert 'Note: --test-nsteps 200 is more than 1 epoch(s) of 12 steps hold: running 12 steps' in out
    config = next(line for line in out.splitlines() if line.startswith('Config'))
    assert 'test_nsteps=200' in config and 'seed=' not in config and 'optimizer=' not in config
    assert '>>> Training on 1 node and 1 process\n' in out
    assert 'GPU throughput' not in out and re.search(r'>>> Train throughput: [\d.]+ images/second; Compute '
                                                     r'throughput: [\d.]+ images/second', out), out


def test_flat_val_folder_gets_the_hint(tmp_path, capsys):
    jpegs(tmp_path / 'data' / 'train' / 'n01', 4)
    jpegs(tmp_path / 'data' / 'val', 4)
    assert run(tmp_path, '--data-dir', tmp_path / 'data', '--test-nsteps', 1) == 2
    assert "It holds 4 images directly: ImageNet's raw val/ is flat" in capsys.readouterr().err


def test_single_class_is_warned(tmp_path, capsys):
    jpegs(tmp_path / 'data' / 'train' / 'n01', 8)
    jpegs(tmp_path / 'data' / 'val' / 'n01', 4)
    assert run(tmp_path, '--data-dir', tmp_path / 'data', '--test-nsteps', 1) == 0
    assert 'Warning: the data has a single class (n01)' in capsys.readouterr().out


def test_host_check_warns_of_oversubscription_and_a_busy_node():
    from dlojzlib.host import host_check
    calm = host_check(1, True, cores=lambda: 4, load=lambda: (0.5, 0, 0), threads=lambda: 2, node_cores=lambda: 4)
    assert calm['warnings'] == [] and calm['usable_cores'] == 4 and calm['torch_threads'] == 2
    many = host_check(64, False, cores=lambda: 2, load=lambda: (0.0, 0, 0), threads=lambda: 2, node_cores=lambda: 2)
    assert many['warnings'] == ['64 loader workers + 1 compute thread(s) exceed the 2 usable cores: they will '
                                'compete (lower --num-workers, or OMP_NUM_THREADS on CPU).']
    busy = host_check(1, False, cores=lambda: 8, load=lambda: (60.0, 0, 0), threads=lambda: 8, node_cores=lambda: 64)
    assert len(busy['warnings']) == 1 and 'load average 60.0 on 64 cores' in busy['warnings'][0]


def test_default_workers_follow_the_usable_cores(monkeypatch):
    import torch
    monkeypatch.setattr(host, 'usable_cores', lambda: 2)
    args = flags.check_args(dlojz.get_args_parser().parse_args([]), torch.device('cpu'))
    assert args.num_workers == 2
    monkeypatch.setenv('SLURM_CPUS_PER_TASK', '10')
    args = flags.check_args(dlojz.get_args_parser().parse_args([]), torch.device('cpu'))
    assert args.num_workers == 10


def test_each_process_gets_its_share_of_the_cores():
    """Hand counts: a CPU run computes on all its cores, a GPU run leaves the workers theirs, ranks that share
    one affinity mask split it, and OMP_NUM_THREADS set by the user (or torchrun) is left alone."""
    from dlojzlib.host import intra_op_threads as t
    env = {}
    assert t(2, True, usable=8, node=8, environ=env) == 8
    assert t(6, False, usable=8, node=8, environ=env) == 2
    assert t(24, False, usable=24, node=96, environ=env) == 1  # srun gave this task 24 of the node's 96 cores
    assert t(2, True, local_ranks=4, usable=16, node=16, environ=env) == 4  # 4 unbound ranks on one node
    assert t(2, True, local_ranks=4, usable=4, node=16, environ=env) == 4  # bound ranks: each its own 4 cores
    assert t(8, False, local_ranks=2, usable=8, node=8, environ=env) == 1
    assert t(2, True, usable=8, node=8, environ={'OMP_NUM_THREADS': '3'}) is None


def test_the_summary_records_the_threads_dlojz_chose(tmp_path, cache_dir, monkeypatch):
    import json
    import torch
    from dlojzlib.host import usable_cores
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # so that a run which chose nothing would record 1, not this machine's cores
    try:
        assert run(tmp_path, '--cache-dir', cache_dir, '--test-nsteps', 1, '--device', 'cpu') == 0
    finally:
        torch.set_num_threads(before)
    with open(tmp_path / 'run' / 'summary.json') as f:
        host = json.load(f)['host']
    assert (host['torch_threads'], host['torch_threads_from']) == (usable_cores(), 'dlojz')

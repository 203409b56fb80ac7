"""The resume contract, flag by flag (long tier): a run stopped by SIGUSR2 after step 3 of 6 (to its
whole process group, as Slurm sends it), then resumed once per flag of --help, in a copy of its
folder, with that flag changed to a value valid on this CPU-only machine. Each resume must do what
the flag's row of record.resume.CONTRACT says:

- honoured: exit 0, the run continued from the checkpoint to step 6, and config.json and summary.json record
  the new value; where the value lives in restored state (the optimizer's, the schedule's, the EMA's) or
  leaves a trace, the run's own outputs show it was used (LRs against torch's schedulers built here, the
  next checkpoint's optimizer groups, files written);
- extends: the run ends at the new length;
- refused (and 'checked' where the checkpoint no longer fits, and the other modes in a training run's folder):
  exit 2, one sentence, every file of the folder byte for byte as before;
- checkpoint: exit 0, one warning line, and the checkpoint's value recorded.

A flag with no row in the contract, or no value here, fails the first test.

Run: python -m pytest -q -m slow tests/test_resume_sweep.py"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import DLOJZ, ROOT, TINY
import dlojz
from dlojzlib import flags
from dlojzlib.data import dali
from dlojzlib.record import resume
from test_resume import onecycle, records, reference_lrs, snapshot

pytestmark = pytest.mark.slow

BASE = [*TINY, '--scheduler', 'cosine', '--log-interval', '1', '--chkpt', '--no-requeue', '--test-nsteps', '6']
LR = 0.1 * 8 / 256  # --base-lr 0.1 x global batch 8 / 256

# dest -> the flags that change it (with what the new value needs to be valid); a callable gets the
# case's folder and returns them
CHANGES = {
    'data_dir': lambda case: ['--data-dir', case.data_copy],
    'stage_dir': lambda case: ['--stage-dir', case.tmp / 'stage'], 'rescan_data': ['--rescan-data'],
    'cache_dir': lambda case: ['--cache-dir', case.tmp / 'c2'], 'synthetic_classes': ['--synthetic-classes', '5'],
    'synthetic_train_per_class': ['--synthetic-train-per-class', '25'],
    'synthetic_val_per_class': ['--synthetic-val-per-class', '7'], 'synthetic_seed': ['--synthetic-seed', '1'],
    'fake_data': ['--fake-data'], 'fake_train_size': ['--fake-train-size', '64'],
    'fake_val_size': ['--fake-val-size', '64'], 'fake_classes': ['--fake-classes', '4'],
    'image_size': ['--image-size', '40'], 'val_resize': ['--val-resize', '40'],
    'val_image_size': ['--val-image-size', '36'], 'decode': ['--decode', 'pil'],
    'decode_ahead': ['--no-decode-ahead'], 'loader': ['--loader', 'dali'], 'skip_bad_images': ['--skip-bad-images'], 'batch_size': ['-b', '4'],
    'val_batch_size': ['--val-batch-size', '8'], 'num_workers': ['--num-workers', '1'],
    'persistent_workers': ['--num-workers', '1', '--no-persistent-workers'], 'pin_memory': ['--pin-memory'],
    'non_blocking': ['--no-non-blocking'], 'prefetch_factor': ['--num-workers', '1', '--prefetch-factor', '4'],
    'drop_last': ['--drop-last'], 'loader_only': ['--loader-only'], 'tune_loader': ['--tune-loader'],
    'arch': ['--arch', 'resnet34'], 'sd_prob': ['--sd-prob', '0.2'], 'n_heads': ['--n-heads', '4'],
    'grad_checkpointing': ['--grad-checkpointing'], 'amp': ['--amp', 'bf16'], 'channels_last': ['--channels-last'],
    'tf32': ['--no-tf32'], 'cudnn_benchmark': ['--no-cudnn-benchmark'], 'deterministic': ['--deterministic'],
    'compile': ['--compile'], 'compile_mode': ['--compile-mode', 'max-autotune-no-cudagraphs'],
    'optimizer': ['--optimizer', 'adamw'], 'lr': ['--lr', '0.5'], 'base_lr': ['--base-lr', '0.2'],
    'wd': ['--wd', '0.01'], 'wd_norm_bias': ['--no-wd-norm-bias'], 'mom': ['--mom', '0.8'],
    'accum_steps': ['--accum-steps', '2'], 'label_smoothing': ['--label-smoothing', '0.2'],
    'scheduler': ['--scheduler', 'onecycle'], 'warmup_epochs': ['--warmup-epochs', '0.5'],
    'poly_power': ['--poly-power', '3'], 'ema_decay': ['--ema-decay', '0.9'], 'ema_warmup': ['--no-ema-warmup'],
    'findlr': ['--findlr'], 'randaugment': ['--randaugment', '1,5'], 'trivialaugment': ['--trivialaugment'],
    'random_erasing': ['--random-erasing', '0.2'], 'mixup': ['--mixup', '0.2'], 'cutmix': ['--cutmix', '1.0'],
    'res_start': ['--res-start', '16'], 'res_end_epoch': ['--res-end-epoch', '1'], 'epochs': ['-e', '2'], 'test': [],
    'test_nsteps': ['--test-nsteps', '8'], 'seed': ['--seed', '7'], 'device': ['--device', 'cpu'], 'output_dir': [],
    'run_name': [], 'overwrite': ['--overwrite'], 'val_every': ['--val-every', '2'],
    'target_top1': ['--target-top1', '0.3'], 'chkpt': [], 'chkpt_every': ['--chkpt-every', '2'],
    'keep_checkpoints': ['--keep-checkpoints', '1'],
    'resume': lambda case: ['--resume', str(case.out / 'checkpoint-00000003.pt')], 'requeue': ['--requeue'],
    'allow_batch_change': ['--allow-batch-change'], 'evaluate': ['--evaluate'], 'sync_bn': ['--sync-bn'],
    'find_unused_parameters': ['--find-unused-parameters'], 'bucket_cap_mb': ['--bucket-cap-mb', '10'],
    'static_graph': ['--static-graph'], 'gradient_as_bucket_view': ['--gradient-as-bucket-view'],
    'broadcast_buffers': ['--no-broadcast-buffers'], 'dist_timeout': ['--dist-timeout', '5'],
    'nccl_debug': ['--nccl-debug'], 'dist_debug': ['--dist-debug'], 'share_gpu': ['--share-gpu'],
    'shard': ['--shard', 'full'], 'cpu_offload': ['--shard', 'full', '--cpu-offload'],
    'pipeline_stages': ['--pipeline-stages', '2'], 'microbatches': ['--microbatches', '2'],
    'pipeline_schedule': ['--pipeline-schedule', 'gpipe'],
    'pipeline_split': ['--pipeline-split', '4'],
    'log_interval': ['--log-interval', '2'], 'metric_step': ['--metric-step', '2'],
    'metric_sync_log': ['--metric-sync-log'], 'wandb': ['--wandb', 'offline'], 'prof': ['--prof'],
    'prof_wait': ['--prof-wait', '2'], 'prof_warmup': ['--prof-warmup', '2'], 'prof_active': ['--prof-active', '2'],
    'timing': ['--no-timing'], 'sync_timing': ['--sync-timing'], 'warmup_steps': ['--warmup-steps', '2'],
    'tune': ['--tune'], 'tune_budget': ['--tune-budget', '5'], 'tune_steps': ['--tune-steps', '5'],
    'tune_memory_gib': ['--tune-memory-gib', '1'], 'tune_max_batch': ['--tune-max-batch', '64'],
    'tune_machine': ['--tune-machine', 'h100'],
}
# Flags with no other valid value on a CPU: refused on CPU with their own sentence, resumed or not.
CPU_REFUSES = {'pin_memory': '--pin-memory only speeds up copies to a GPU',
               'sync_bn': "--sync-bn needs CUDA GPUs"}
# Flags this run's ResNet cannot take, resumed or not (tests/test_pipeline.py resumes a pipeline).
ARCH_REFUSES = {'microbatches': 'BatchNorm over microbatches'}
# What a 'checked' flag does here: refused where the change reaches the data, the weights or the
# groups.
CHECKED_REFUSED = {'synthetic_classes', 'synthetic_train_per_class', 'fake_data', 'wd_norm_bias'}


def dests():
    actions = flags.get_args_parser()._actions
    return sorted(a.dest for a in actions if a.option_strings and a.dest != 'help')


def test_every_flag_has_a_row_and_a_value_here():
    assert set(resume.CONTRACT) == set(dests()) == set(CHANGES)


@pytest.fixture(scope='module')
def stopped(tmp_path_factory, cache_dir):
    """The run stopped after step 3 by SIGUSR2 to its process group (checkpoint-3, 'preempted', exit
    5)."""
    out = tmp_path_factory.mktemp('stopped') / 'run'
    p = subprocess.run([sys.executable, DLOJZ, *BASE, '--cache-dir', cache_dir, '--output-dir', str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, start_new_session=True,
                       env={**os.environ, 'DLOJZ_FAULT': 'signal-step:3:SIGUSR2'})
    assert p.returncode == 5 and 'stopped by SIGUSR2 at step 3' in p.stderr, p.stderr[-2000:]
    assert json.load(open(out / 'summary.json'))['status'] == 'preempted'
    data = tmp_path_factory.mktemp('data') / 'copy'
    shutil.copytree(os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0'), data)
    return out, str(data)


class Case:
    def __init__(self, tmp, out, data_copy):
        self.tmp, self.out, self.data_copy = tmp, out, data_copy


def cosine(peak, total=12):
    return reference_lrs(lambda o: (o.param_groups[0].update(lr=peak, initial_lr=peak),
                                    torch.optim.lr_scheduler.CosineAnnealingLR(o, total))[1], total)


def last_checkpoint(out):
    return torch.load(os.path.join(out, 'checkpoint-00000006.pt'), map_location='cpu', weights_only=False)


# Evidence that a run used a value held in restored state, or one that leaves a trace of its own.
USED = {
    'lr': lambda out: [r['lr'] for r in records(out)[3:]] == pytest.approx(cosine(0.5)[3:6], rel=1e-9),
    'base_lr': lambda out: [r['lr'] for r in records(out)[3:]] == pytest.approx(cosine(0.2 * 8 / 256)[3:6], rel=1e-9),
    'scheduler': lambda out: [r['lr'] for r in records(out)[3:]] == pytest.approx(onecycle(LR, 12)[3:6], rel=1e-9),
    'wd': lambda out: last_checkpoint(out)['optimizer']['param_groups'][0]['weight_decay'] == 0.01,
    'mom': lambda out: last_checkpoint(out)['optimizer']['param_groups'][0]['momentum'] == 0.8,
    'ema_decay': lambda out: json.load(open(os.path.join(out, 'summary.json')))['val_ema'] is not None,
    'num_workers': lambda out: json.load(open(os.path.join(out, 'summary.json')))['host']['num_workers'] == 1,
    'chkpt': lambda out: not os.path.exists(os.path.join(out, 'checkpoint-00000006.pt')),
    'keep_checkpoints': lambda out: sorted(n for n in os.listdir(out) if n.startswith('checkpoint-')) ==
    ['checkpoint-00000006.pt'],
    'nccl_debug': lambda out: os.path.exists(os.path.join(out, 'nccl.rank0.log')),
    'wandb': lambda out: os.path.isdir(os.path.join(out, 'wandb')),
    'prof': lambda out: os.path.isdir(os.path.join(out, 'profiler')),
    'resume': lambda out: records(out, 'resume')[-1]['checkpoint'].endswith('checkpoint-00000003.pt'),
}


@pytest.fixture
def environment():
    """The variables a run exports (--nccl-debug, --dist-debug, --deterministic) go with it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize('dest', dests())
def test_a_resume_with_one_flag_changed_follows_its_row(dest, stopped, tmp_path, cache_dir, capsys, monkeypatch,
                                                        environment):
    base_out, data_copy = stopped
    out = tmp_path / 'run'
    shutil.copytree(base_out, out)
    monkeypatch.chdir(tmp_path)  # --run-name's runs/<name>
    monkeypatch.setenv('HOME', str(tmp_path))  # wandb's own logs (~/.cache/wandb) stay in the test's folder
    # .ci/run's DALI stage runs this case with DALI installed
    if dest == 'loader' and dali.dali() is None:
        pytest.skip('NVIDIA DALI is not installed')
    case = Case(tmp_path, out, data_copy)
    change = CHANGES[dest](case) if callable(CHANGES[dest]) else CHANGES[dest]
    argv = [*BASE, '--cache-dir', cache_dir, '--output-dir', str(out), '--resume', 'auto']
    if dest == 'test':  # no --test-nsteps: a full epoch (12 steps)
        del argv[argv.index('--test-nsteps'):argv.index('--test-nsteps') + 2]
    if dest == 'chkpt':  # store_true: the change is its absence
        argv.remove('--chkpt')
    if dest == 'run_name':  # a folder named runs/<name>, which holds no checkpoint: a fresh start there
        argv[argv.index('--output-dir'):argv.index('--output-dir') + 2] = ['--run-name', 'sweep']
    argv += [str(a) for a in change]
    before = snapshot(out)
    code = dlojz.cli(argv)
    got = capsys.readouterr()
    rule = resume.CONTRACT[dest][0]
    refused = dest in CPU_REFUSES or dest in ARCH_REFUSES or rule in ('refused', 'mode') \
        or dest in CHECKED_REFUSED
    if refused:
        assert code == 2 and got.err.count('\n') == 1 and got.err.startswith('dlojz: error: '), got.err[-2000:]
        assert 'Traceback' not in got.err and snapshot(out) == before
        if dest in CPU_REFUSES or dest in ARCH_REFUSES:
            assert {**CPU_REFUSES, **ARCH_REFUSES}[dest] in got.err
        return
    assert code == 0 and 'Traceback' not in got.err, got.err[-3000:]
    where = tmp_path / 'runs' / 'sweep' if dest == 'run_name' else out
    summary = json.load(open(where / 'summary.json'))
    config = json.load(open(where / 'config.json'))
    assert summary['status'] == 'completed' and summary['config'] == config
    expected = flags.get_args_parser().parse_args(argv)
    if rule == 'checkpoint':
        old = torch.load(base_out / 'checkpoint-00000003.pt', map_location='cpu', weights_only=False)['args'][dest]
        assert config[dest] == old != getattr(expected, dest)
        assert f'Warning: {resume.flag(dest)} ' in got.out
    elif dest == 'base_lr':
        assert config['base_lr'] == 0.2 and config['lr'] == pytest.approx(0.2 * 8 / 256)
    elif dest in ('test', 'chkpt', 'output_dir'):
        assert config[dest] == {'test': False, 'chkpt': False, 'output_dir': str(out)}[dest]
    else:
        assert config[dest] == getattr(expected, dest), (config[dest], getattr(expected, dest))
    if dest == 'run_name':
        assert 'starting from the beginning' in got.out and summary['global_step'] == 6
    else:
        assert ('continuing from' in got.out or dest == 'resume') and records(out, 'resume')  # a path: no search
        steps = [r['global_step'] for r in records(out)]
        length = {'test': 12, 'test_nsteps': 8}.get(dest, 6)
        assert summary['global_step'] == length and (dest == 'log_interval' or steps == list(range(1, length + 1)))
    if dest in USED:
        assert USED[dest](where), dest

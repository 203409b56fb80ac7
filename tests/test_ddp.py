"""Data parallelism on CPU with gloo, through the real entry point (torchrun and srun-like launches):

- 2 ranks x batch b update the weights exactly as one process accumulating 2 micro-batches of b (the
  reference loop below uses torchvision's model and torch's DistributedSampler, not dlojz's code);
- validation counts every image once and gives the same top-1 at world sizes 1, 2 and 3;
- unused parameters: one sentence naming --find-unused-parameters without it, success with it;
- a killed or hung rank ends the others within --dist-timeout with a sentence, not a hang;
- resume at another world size for the same global batch; another global batch is refused;
- per-rank timings, the all-reduce volume, synced metrics and --nccl-debug's log in the run directory.

Run: python -m pytest -q tests/test_ddp.py
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
import torchvision

from conftest import (TINY, free_port, latest, run_cli, run_main, srun_like, stderr_of, torchrun,
                      wait_all)
import dlojz
from dlojzlib.data import datasets as D
from dlojzlib.data import decode as DD
from dlojzlib.data.datasets import IMAGENET_MEAN, IMAGENET_STD

# The equivalence run: SGD with momentum at a constant LR. The LR is small because at this tiny batch
# size larger steps amplify float rounding (1e-7 after one step) into 1e-3 differences within 3 steps.
EQUIV = ['--test-nsteps', '4', '--lr', '0.002', '--scheduler', 'constant', '--label-smoothing', '0.1', '--wd', '0',
         '--log-interval', '1', '--chkpt']


def summary_of(out):
    with open(os.path.join(out, 'summary.json')) as f:
        return json.load(f)


def records_of(out):
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def reference_weights(cache_dir, micro_batches, steps=4, b=8, lr=0.002):
    """Independent single-process reference: torchvision resnet18, torch's DistributedSampler order; each
    optimizer step sums the gradients of `micro_batches` (list of shard ranks) with the loss divided by
    their number, i.e. the gradient mean DDP computes. BatchNorm sees each micro-batch alone, as on a rank.
    One intra-op thread, as the ranks have (torchrun's OMP_NUM_THREADS=1): CPU kernels split their sums by
    thread, so another thread count rounds differently, and a near-tie in a max-pool window can then pick
    another pixel (measured at step 4 with 2 threads: 0.028 on a gradient, 5.6e-5 on the weights)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_weights(cache_dir, micro_batches, steps, b, lr)
    finally:
        torch.set_num_threads(threads)


def _reference_weights(cache_dir, micro_batches, steps, b, lr):
    root = os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0')
    _, train, _ = D.scan_imagefolder(root)
    ds = D.ImageFolderDataset(train, DD.FastTrainTransform(32), seed=123)
    torch.manual_seed(123)
    model = torchvision.models.resnet18(num_classes=4)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    world = len(micro_batches)
    orders = []
    for r in micro_batches:
        s = torch.utils.data.distributed.DistributedSampler(range(len(ds)), num_replicas=world, rank=r,
                                                            shuffle=True, seed=123)
        s.set_epoch(0)
        orders.append(list(s))
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    model.train()
    for step in range(steps):
        opt.zero_grad()
        for order in orders:
            items = [ds[(i, 0)] for i in order[step * b:(step + 1) * b]]
            x = (torch.stack([im for im, _ in items]).float() - mean) / std
            y = torch.tensor([label for _, label in items])
            (crit(model(x), y) / world).backward()
        opt.step()
    return {k: v for k, v in model.state_dict().items() if 'running' not in k and 'num_batches' not in k}


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory, cache_dir):
    """One torchrun launch of 2 ranks x 8 images for 4 steps, with --metric-sync-log and --nccl-debug.
    -> (run directory, the launch's CompletedProcess)."""
    out = tmp_path_factory.mktemp('ddp') / 'run'
    run_main(out.parent / 'warm', cache_dir, '--test-nsteps', '1')  # the dataset exists before the launch
    p = torchrun(2, *TINY, '--cache-dir', cache_dir, '--output-dir', out, *EQUIV, '--metric-step', '2',
                 '--metric-sync-log', '--nccl-debug')
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p


def test_two_ranks_equal_gradient_accumulation(two_ranks, cache_dir):
    got = torch.load(latest(two_ranks[0]), weights_only=False)['model']
    ref = reference_weights(cache_dir, micro_batches=[0, 1])
    for k, v in ref.items():
        # bit for bit: same thread count, so the same kernels' sums; the loss / 2 and DDP's gradient / 2 are
        # exact (a power of 2), and gloo's sum of 2 ranks is the reference's accumulation a + b
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    # The comparison is sensitive: one plain batch of 16 (BatchNorm over 16) lands elsewhere.
    plain = reference_weights(cache_dir, micro_batches=[0], b=16)
    assert max((plain[k] - got[k]).abs().max().item() for k in ref) > 1e-2  # measured: 0.024


def test_one_rank_accumulating_two_micro_batches_equals_two_ranks(two_ranks, tmp_path, cache_dir):
    """--accum-steps 2 on one process takes the micro-batches the two ranks took (the same BatchNorm groups)
    and adds their gradients: the same weights as the reference and as the 2-rank run, bit for bit."""
    out = tmp_path / 'accum'
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', out, *EQUIV, '--accum-steps', '2',
                env={'OMP_NUM_THREADS': '1'})  # the reference's and the ranks' thread count
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(latest(out), weights_only=False)
    ddp = torch.load(latest(two_ranks[0]), weights_only=False)
    assert got['global_batch'] == ddp['global_batch'] == 16 and got['global_step'] == 4
    for k, v in reference_weights(cache_dir, micro_batches=[0, 1]).items():
        torch.testing.assert_close(got['model'][k], v, rtol=0, atol=0, msg=k)
        torch.testing.assert_close(got['model'][k], ddp['model'][k], rtol=0, atol=0, msg=k)
    s = summary_of(out)
    assert s['global_batch'] == 16 and s['timing']['steps'] == 4
    assert 'global batch size: 16 - mini batch size: 8 (2 micro-batches per step)' in p.stdout


@pytest.mark.slow
def test_accumulation_resumes_at_another_world_size(two_ranks, tmp_path, cache_dir):
    """The 2-rank run's checkpoint after 4 steps continued by one process with --accum-steps 2: the same
    global batch, so no flag is needed, and the position in each virtual rank's order is kept: steps 5 and 6
    are those of a single process accumulating from the start."""
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'more', *EQUIV[2:], '--test-nsteps',
                '6', '--accum-steps', '2', '--resume', latest(two_ranks[0]), env={'OMP_NUM_THREADS': '1'})
    assert p.returncode == 0, p.stderr[-3000:]
    ref = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'ref', *EQUIV[2:], '--test-nsteps',
                  '6', '--accum-steps', '2', env={'OMP_NUM_THREADS': '1'})
    assert ref.returncode == 0, ref.stderr[-3000:]
    losses = lambda out: {r['global_step']: r['loss'] for r in records_of(out) if r['type'] == 'train'}
    got, want = losses(tmp_path / 'more'), losses(tmp_path / 'ref')
    assert sorted(got) == [5, 6] and [got[5], got[6]] == [want[5], want[6]]  # bit for bit


def test_per_rank_timings_and_allreduce_estimate(two_ranks):
    s = summary_of(two_ranks[0])
    assert (s['status'], s['world_size'], s['global_batch']) == ('completed', 2, 16)
    t = s['timing']
    assert [r['rank'] for r in t['ranks']] == [0, 1] and all(r['steps'] == 4 for r in t['ranks'])
    medians = [r['step_median_s'] for r in t['ranks']]
    assert t['slowest_step_median_s'] == max(medians) and t['rank_skew'] == pytest.approx(
        max(medians) / min(medians) - 1)
    n_params = sum(p.numel() for p in torchvision.models.resnet18(num_classes=4).parameters())
    assert s['communication']['gradient_bytes_per_step'] == 4 * n_params


def test_metric_sync_gives_every_rank_the_mean(two_ranks):
    """After the sync every rank holds the mean of the ranks' own values (equal batch sizes)."""
    out, p = two_ranks
    syncs = [r for r in records_of(out) if r['type'] == 'metric_sync']
    assert [r['step'] for r in syncs] == [2, 4]
    ranks = syncs[0]['ranks']
    assert ranks[0]['after'] == ranks[1]['after']
    assert ranks[0]['after']['loss'] == pytest.approx((ranks[0]['before']['loss'] + ranks[1]['before']['loss']) / 2)
    assert ranks[0]['after']['top1'] == pytest.approx((ranks[0]['before']['top1'] + ranks[1]['before']['top1']) / 2)
    assert 'Before metric compute CPU1' in p.stdout


def test_nccl_debug_logs_each_rank_with_step_markers(two_ranks):
    for r in (0, 1):
        log = (two_ranks[0] / f'nccl.rank{r}.log').read_text()
        assert [f'Train step {k} - rank {r}' in log for k in range(5)] == [True] * 5
        assert f'Validation - rank {r}' in log


@pytest.mark.slow
def test_exact_validation_at_any_world_size(tmp_path, cache_dir):
    """25 validation images: not divisible by 2 or 3; DistributedSampler would evaluate 26 and 27."""
    five = ['--synthetic-classes', '5', '--synthetic-val-per-class', '5', '--val-batch-size', '4']
    run_main(tmp_path / 'train', cache_dir, *five, '--test-nsteps', '4', '--chkpt', '--lr', '0.01')
    ckpt = latest(tmp_path / 'train')
    evals = {1: run_main(tmp_path / 'w1', cache_dir, *five, '--evaluate', '--resume', ckpt)[0]}
    p = torchrun(2, *TINY, *five, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'w2', '--evaluate',
                 '--resume', ckpt)
    assert p.returncode == 0, p.stderr[-3000:]
    evals[2] = summary_of(tmp_path / 'w2')
    procs = srun_like(3, *TINY, *five, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'w3', '--evaluate',
                      '--resume', ckpt, log_dir=tmp_path)
    codes = wait_all(procs)
    assert codes == [0, 0, 0], stderr_of(tmp_path, codes)
    evals[3] = summary_of(tmp_path / 'w3')
    for w, s in evals.items():
        assert (s['status'], s['mode'], s['world_size']) == ('completed', 'evaluate', w)
        assert s['val']['images'] == 25, w
        assert s['val']['top1'] == evals[1]['val']['top1'], w
        assert s['val']['loss'] == pytest.approx(evals[1]['val']['loss'], rel=1e-5), w
    # at world size 3 the shards are 9/8/8 images: 3, 2 and 2 batches of 4
    assert [r['rank'] for r in evals[3]['timing']['ranks']] == [0, 1, 2]
    assert evals[3]['val']['batches'] == 3


def test_one_srun_task_needs_no_port_of_its_own(tmp_path, cache_dir):
    """A one-task job (cpu.slurm, a 1-GPU job) trains even when the port its job id gives is taken:
    nobody else has to find its store, so the system picks a free port."""
    import socket
    with socket.socket() as held:
        held.bind(('127.0.0.1', free_port(20000, 30000)))
        held.listen()
        job_id = held.getsockname()[1] - 20000  # the port dlojz would derive from this job id
        procs = srun_like(1, *TINY, '--test-nsteps', '2', '--cache-dir', cache_dir, '--output-dir',
                          tmp_path / 'run', log_dir=tmp_path, job_id=job_id)
        codes = wait_all(procs)
    assert codes == [0], stderr_of(tmp_path, codes)
    s = summary_of(tmp_path / 'run')
    assert (s['status'], s['world_size']) == ('completed', 1)


HEADS = ['--arch', 'resnet18-heads', '--test-nsteps', '3']


@pytest.mark.slow
def test_unused_parameters_get_a_sentence(tmp_path, cache_dir):
    procs = srun_like(2, *TINY, *HEADS, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'bad', log_dir=tmp_path)
    assert wait_all(procs) == [2, 2]
    for r in (0, 1):
        err = (tmp_path / f'rank{r}.err').read_text()
        assert 'rerun with --find-unused-parameters' in err and 'Traceback' not in err, err[-2000:]
    assert summary_of(tmp_path / 'bad')['status'] == 'failed'


@pytest.mark.slow
def test_unused_parameters_train_with_the_flag(tmp_path, cache_dir):
    p = torchrun(2, *TINY, *HEADS, '--cache-dir', cache_dir, '--output-dir', tmp_path, '--find-unused-parameters')
    assert p.returncode == 0, p.stderr[-3000:]
    assert summary_of(tmp_path)['global_step'] == 3


@pytest.mark.slow
def test_stochastic_depth_needs_no_unused_parameter_flag(tmp_path, cache_dir):
    """It masks branches instead of skipping them: every parameter gets a gradient."""
    p = torchrun(2, *TINY, '--arch', 'resnet18-sd', '--test-nsteps', '3', '--cache-dir', cache_dir,
                 '--output-dir', tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGSTOP], ids=['killed', 'hung'])
def test_dead_rank_ends_the_job_within_dist_timeout(tmp_path, cache_dir, sig):
    timeout_s = 15
    flags = ['--fake-data', '--fake-train-size', '100000', '--fake-classes', '4', '--arch', 'resnet18',
             '--image-size', '32', '-b', '8', '--num-workers', '0', '--wandb', 'off', '--log-interval', '1',
             '--dist-timeout', str(timeout_s / 60), '--output-dir', tmp_path / 'run']
    procs = srun_like(2, *flags, log_dir=tmp_path)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until training runs
            if (tmp_path / 'run' / 'metrics.jsonl').exists() and len(records_of(tmp_path / 'run')) >= 3:
                break
            assert procs[0].poll() is None, (tmp_path / 'rank0.err').read_text()
            time.sleep(0.2)
        else:
            pytest.fail('training did not start')
        procs[1].send_signal(sig)
        # without --dist-timeout gloo would wait 30 min; 15 s plus a generous margin for a busy machine
        code = procs[0].wait(timeout=timeout_s + 165)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = (tmp_path / 'rank0.err').read_text()
    assert code == 4 and 'another rank died or stopped answering' in err and 'Traceback' not in err, err[-2000:]
    assert summary_of(tmp_path / 'run')['status'] == 'failed'


@pytest.fixture(scope='module')
def three_steps(tmp_path_factory, cache_dir):
    """A checkpoint after 3 steps of 8 images (of 2 epochs)."""
    out = tmp_path_factory.mktemp('three-steps')
    run_main(out, cache_dir, '--test-nsteps', '3', '--chkpt', '-e', '2')
    return latest(out)


@pytest.mark.slow
def test_resume_at_another_world_size(tmp_path, cache_dir, three_steps):
    """Same global batch (8) as 2 ranks x 4: allowed, continues at step 4."""
    p = torchrun(2, *TINY, '-b', '4', '--cache-dir', cache_dir, '--output-dir', tmp_path, '--resume', three_steps,
                 '--test-nsteps', '5', '-e', '2', '--log-interval', '1')
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r['global_step'] for r in records_of(tmp_path) if r['type'] == 'train'] == [4, 5]


def test_another_global_batch_is_refused(tmp_path, cache_dir, three_steps, capsys):
    code = dlojz.cli([*TINY, '-b', '4', '--cache-dir', cache_dir, '--output-dir', str(tmp_path / 'run'), '--resume',
                      str(three_steps)])
    err = capsys.readouterr().err
    assert code == 2 and err.count('\n') == 1 and '--allow-batch-change' in err and 'Traceback' not in err
    assert not (tmp_path / 'run').exists()  # refused before anything was written: no empty folder left


def test_another_global_batch_with_the_flag_keeps_the_position_in_images(tmp_path, cache_dir, three_steps):
    run_main(tmp_path, cache_dir, '-b', '4', '--resume', three_steps, '--allow-batch-change', '--test-nsteps', '8',
             '-e', '2', '--log-interval', '1')
    steps = [r['global_step'] for r in records_of(tmp_path) if r['type'] == 'train']
    assert steps == [7, 8]  # 3 steps of 8 images = 24 images = 6 steps of 4


@pytest.mark.parametrize('flags, words', [(['--sync-bn', '--device', 'cpu'], 'SyncBatchNorm does not run on CPU'),
                                          (['--evaluate'], '--resume PATH')])
def test_cpu_refusals_are_sentences(tmp_path, cache_dir, capsys, flags, words):
    code = dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path / 'x'), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count('\n') == 1 and words in err
    assert not (tmp_path / 'x').exists()


def test_stdout_tee_keeps_c_and_python_output_in_order(tmp_path):
    """NCCL writes its INFO lines with C stdio; dlojz's markers with Python. Both must land in order."""
    code = f'''
import ctypes, sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
from dlojzlib.dist import launch
tee = launch.StdoutTee({str(tmp_path / 'log')!r})
libc = ctypes.CDLL(None)
for i in range(3):
    print(f'py {{i}}', flush=True)
    libc.printf(b'c %d\\n', i)
tee.close()
print('after')
'''
    import subprocess
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    expected = ['py 0', 'c 0', 'py 1', 'c 1', 'py 2', 'c 2']
    assert (tmp_path / 'log').read_text().split('\n')[:-1] == expected
    assert p.stdout.split('\n')[:-1] == expected + ['after']


@pytest.mark.slow
def test_each_rank_resumes_its_own_device_rng(tmp_path, cache_dir):
    """Checkpoints hold every rank's own device generator (gathered to rank 0), and each rank restores its
    own: the whole-node get_rng_state_all() of rank 0 made other ranks restart a stream rank 0 never drew
    from, and failed with fewer visible GPUs. A fake device generator (tests/fake_device_rng.py) stands in
    for CUDA's; at world size 1 the checkpoint of 2 ranks resumes without error."""
    script, log = os.path.join(os.path.dirname(__file__), 'fake_device_rng.py'), str(tmp_path / 'restored')
    out = tmp_path / 'run'
    flags = [*TINY, '--cache-dir', cache_dir, '--output-dir', out, '--chkpt']
    p = torchrun(2, *flags, '--test-nsteps', '3', script=script, env={'FAKE_RNG_LOG': log})
    assert p.returncode == 0, p.stderr[-3000:]
    saved = torch.load(latest(out), weights_only=False)['rng']['device']
    assert [s.tolist() for s in saved] == [[0, 3], [1, 3]]
    p = torchrun(2, *flags, '--test-nsteps', '5', '--resume', 'auto', script=script, env={'FAKE_RNG_LOG': log})
    assert p.returncode == 0, p.stderr[-3000:]
    assert [json.load(open(f'{log}.rank{r}')) for r in (0, 1)] == [[0, 3], [1, 3]]
    os.remove(f'{log}.rank0')
    one = subprocess.run([sys.executable, script, *map(str, flags), '-b', '16', '--test-nsteps', '6', '--resume',
                          str(latest(out))], capture_output=True, text=True, env={**os.environ, 'FAKE_RNG_LOG': log})
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.load(open(f'{log}.rank0')) == [0, 5]


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """The stop flag is agreed by an all-reduce started at each step and read at the next: SIGUSR2 to rank 1
    only stops both ranks at one step, and rank 0 checkpoints it."""
    flags = ['--fake-data', '--fake-train-size', '100000', '--fake-classes', '4', '--arch', 'resnet18',
             '--image-size', '32', '-b', '8', '--num-workers', '0', '--wandb', 'off', '--log-interval', '1',
             '--output-dir', tmp_path / 'run']
    procs = srun_like(2, *flags, log_dir=tmp_path)
    try:
        deadline = time.time() + 120
        while not ((tmp_path / 'run' / 'metrics.jsonl').exists() and len(records_of(tmp_path / 'run')) >= 3):
            assert time.time() < deadline and procs[0].poll() is None, (tmp_path / 'rank0.err').read_text()
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGUSR2)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        wait_all(procs, timeout=1)
    errs = [(tmp_path / f'rank{r}.err').read_text() for r in (0, 1)]
    assert codes == [5, 5], errs
    s = summary_of(tmp_path / 'run')
    assert s['status'] == 'preempted' and 'stopped by a signal on another rank' in errs[0]
    assert torch.load(s['checkpoint'], weights_only=False)['global_step'] == s['global_step']

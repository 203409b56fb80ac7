"""The resume contract (record.resume, docs/resume.md): a resumed run uses what it is given, or says
why not.

- A completed run given more epochs continues from its last checkpoint: its LR schedule is rebuilt for the new
  length (the LRs of the new steps are torch's OneCycleLR for that length, built here), every step is logged
  once and the run ends 'completed' (it crashed on the finished schedule, and was recorded 'crashed').
- The same command on a completed run says so in one line, exits 0 and leaves every file byte for byte; a
  length below the checkpoint's is refused with one sentence, also leaving every file.
- A flag changed on resume is used: --lr's new schedule (torch's OneCycleLR again), --wd in the optimizer's
  groups (read from the next checkpoint), and recorded; --seed is kept from the checkpoint with a warning and
  recorded as kept.
- The contract has a row for every flag of --help, and docs/resume.md shows each row.
- A rank other than 0 that cannot start says so, tagged with its rank and host (it printed nothing); a peer
  that accepts the connection and never answers ends in one sentence, not in C++ frame dumps.

Run: python -m pytest -q -m "" tests/test_resume.py    (the two ranks' tests are slow; the sweep over every flag:
     tests/test_resume_sweep.py, slow)
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
import torch

from conftest import DLOJZ, ROOT, TINY, free_port, latest
import dlojz
from dlojzlib import flags
from dlojzlib.record import resume

LR = 0.1 * 8 / 256  # --base-lr 0.1 per 256 images x the tiny config's global batch of 8


def cli(capsys, out, cache_dir, *flags):
    code = dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--log-interval', '1',
                      *map(str, flags)])
    got = capsys.readouterr()
    return code, got.out, got.err


def snapshot(out):
    return {n: open(os.path.join(out, n), 'rb').read() for n in sorted(os.listdir(out))}


def records(out, kind='train'):
    return [r for r in map(json.loads, open(os.path.join(out, 'metrics.jsonl'))) if r['type'] == kind]


def reference_lrs(make, steps):
    """The LR of each step 1..steps from a torch scheduler made here, `make(optimizer)`: a
    reference."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0, momentum=0.9)
    sched = make(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]['lr'])
        opt.step()
        sched.step()
    return lrs


def onecycle(max_lr, total):
    """torch's OneCycleLR with its defaults, as dlojz builds it."""
    return reference_lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=max_lr, total_steps=total), total)


@pytest.fixture(scope='module')
def completed(tmp_path_factory, cache_dir):
    """A completed 2-epoch run with checkpoints (24 steps of 8 images), kept read-only: tests copy
    it."""
    out = tmp_path_factory.mktemp('completed') / 'run'
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--log-interval', '1', '-e', '2',
                      '--chkpt']) == 0
    return out


def copy_of(run, tmp_path):
    import shutil
    dst = tmp_path / 'run'
    shutil.copytree(run, dst)
    return dst


def test_a_completed_run_given_more_epochs_continues(completed, tmp_path, cache_dir, capsys):
    out = copy_of(completed, tmp_path)
    code, stdout, err = cli(capsys, out, cache_dir, '-e', '3', '--chkpt', '--resume', 'auto')
    assert code == 0, err
    summary = json.load(open(out / 'summary.json'))
    assert summary['status'] == 'completed' and summary['global_step'] == 36
    steps = [r['global_step'] for r in records(out)]
    assert steps == list(range(1, 37))  # each step logged once, the first 24 by the first run
    assert [r['epoch'] for r in records(out, 'val')] == [1, 2, 3]
    # the LRs of the new steps follow a one-cycle schedule of 36 steps, at their place in it
    ref = onecycle(LR, 36)
    assert [r['lr'] for r in records(out)[24:]] == pytest.approx(ref[24:], rel=1e-9)
    assert 'The LR schedule is rebuilt for --epochs 3 (was 2): it continues at step 24' in stdout
    assert json.load(open(out / 'config.json'))['epochs'] == 3


def test_the_same_command_on_a_completed_run_changes_nothing(completed, tmp_path, cache_dir, capsys):
    out = copy_of(completed, tmp_path)
    before = snapshot(out)
    code, stdout, err = cli(capsys, out, cache_dir, '-e', '2', '--chkpt', '--resume', 'auto')
    assert code == 0 and err.count('\n') == 1, err
    assert f'dlojz: the run in {out} is complete (step 24, validation top-1 ' in err
    assert snapshot(out) == before


def test_a_length_below_the_checkpoint_is_refused(completed, tmp_path, cache_dir, capsys):
    out = copy_of(completed, tmp_path)
    before = snapshot(out)
    code, stdout, err = cli(capsys, out, cache_dir, '-e', '1', '--chkpt', '--resume', 'auto')
    assert code == 2 and err.count('\n') == 1 and 'Traceback' not in err
    assert f'checkpoint {out}/checkpoint-00000024.pt is at step 24 but this run ends at step 12' in err
    assert 'pass -e 2 or more to continue it' in err
    assert snapshot(out) == before


def test_changed_flags_are_used_or_kept_and_recorded(tmp_path, cache_dir, capsys):
    """4 steps of epoch 1 (of 12 steps), then 4 more with --lr 0.5, --wd 0.01 and --seed 7."""
    out = tmp_path / 'run'
    code, _, err = cli(capsys, out, cache_dir, '--test-nsteps', '4', '--chkpt')
    assert code == 0, err
    code, stdout, err = cli(capsys, out, cache_dir, '--test-nsteps', '8', '--chkpt', '--resume', 'auto',
                            '--lr', '0.5', '--wd', '0.01', '--seed', '7')
    assert code == 0, err
    train = records(out)
    assert [r['global_step'] for r in train] == list(range(1, 9))
    assert [r['lr'] for r in train[:4]] == pytest.approx(onecycle(LR, 12)[:4], rel=1e-9)
    assert [r['lr'] for r in train[4:]] == pytest.approx(onecycle(0.5, 12)[4:8], rel=1e-9)
    ckpt = torch.load(latest(out), map_location='cpu', weights_only=False)
    assert ckpt['global_step'] == 8 and ckpt['optimizer']['param_groups'][0]['weight_decay'] == 0.01
    config = json.load(open(out / 'config.json'))
    assert (config['lr'], config['wd'], config['seed']) == (0.5, 0.01, 123)
    assert json.load(open(out / 'summary.json'))['config']['seed'] == 123
    assert 'Warning: --seed 7 differs from the checkpoint\'s 123: the run keeps 123' in stdout
    assert '--lr 0.5 (was 0.003125)' in stdout and '--wd 0.01 (was 0.0)' in stdout


def test_a_changed_optimizer_is_refused_in_one_sentence(completed, tmp_path, cache_dir, capsys):
    out = copy_of(completed, tmp_path)
    before = snapshot(out)
    code, _, err = cli(capsys, out, cache_dir, '-e', '3', '--chkpt', '--resume', 'auto', '--optimizer', 'adamw')
    assert code == 2 and err.count('\n') == 1
    assert "--optimizer adamw differs from the checkpoint's sgd and a resumed run cannot change it" in err
    assert snapshot(out) == before


def test_the_contract_has_a_row_for_every_flag_and_the_docs_show_it():
    actions = flags.get_args_parser()._actions
    dests = {a.dest for a in actions if a.option_strings and a.dest != 'help'}
    assert dests == set(resume.CONTRACT)
    page = open(os.path.join(ROOT, 'docs', 'resume.md')).read()
    rows = dict(re.findall(r'^\| `(--[a-z0-9-]+)` \| (\w+) \|', page, flags=re.M))
    assert rows == {resume.flag(d): rule for d, (rule, _) in resume.CONTRACT.items()}


def rank_cli(cache_dir, out, rank, port, addr='127.0.0.1'):
    env = {**os.environ, 'RANK': str(rank), 'WORLD_SIZE': '2', 'MASTER_ADDR': addr, 'MASTER_PORT': str(port),
           'OMP_NUM_THREADS': '1'}
    return subprocess.run([sys.executable, DLOJZ, *TINY, '--cache-dir', cache_dir, '--output-dir', str(out),
                           '--test-nsteps', '1', '--dist-timeout', '0.05'], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


@pytest.mark.slow  # launches that wait for --dist-timeout: 20 s
def test_a_rank_that_cannot_join_says_so_in_one_tagged_sentence(tmp_path, cache_dir):
    """Rank 1 with no rank 0 (it printed nothing, exit 2), and rank 0 whose peer never comes."""
    host = socket.gethostname()
    r = rank_cli(cache_dir, tmp_path / 'a', 1, free_port())
    assert r.returncode == 2 and r.stderr.count('\n') == 1, r.stderr
    assert r.stderr.startswith(f'dlojz: error: [rank 1 on {host}] could not join the process group at 127.0.0.1:')
    r = rank_cli(cache_dir, tmp_path / 'b', 0, free_port())
    assert r.returncode == 2 and r.stderr.count('\n') == 1, r.stderr
    assert f'[rank 0 on {host}] could not join' in r.stderr and '1/2 clients joined' in r.stderr
    assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()


@pytest.mark.slow
def test_a_peer_that_never_answers_ends_in_one_sentence_not_cpp_frames(tmp_path, cache_dir):
    """The rank 0 address is something else's (here a listener that answers every connection as a
    web server would, as a proxy in front of an unreachable address did on this machine): the
    store's client retries until its timeout and torch's C++ logs a frame dump at each attempt,
    which dlojz holds back (the sentence carries the reason). A listener that accepts and stays
    silent is not tested: torch's client then waits past its timeout (over 120 s with --dist-timeout
    0.05 on torch 2.14)."""
    server = socket.socket()
    server.bind(('127.0.0.1', 0))
    server.listen(8)

    def answer():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b'HTTP/1.1 400 Bad Request\r\n\r\n')
            conn.close()
    threading.Thread(target=answer, daemon=True).start()
    try:
        r = rank_cli(cache_dir, tmp_path / 'a', 1, server.getsockname()[1])
    finally:
        server.close()
    assert r.returncode == 2 and 'frame #' not in r.stderr and r.stderr.count('\n') == 1, r.stderr
    assert 'could not join the process group' in r.stderr


def test_a_completed_run_without_checkpoints_is_not_restarted(tmp_path, cache_dir, capsys):
    """No checkpoint to continue from: a longer run is refused in one sentence (it started again
    from step 0 in the folder, rewriting the completed run's metrics.jsonl and summary.json)."""
    out = tmp_path / 'run'
    assert cli(capsys, out, cache_dir, '--test-nsteps', '2')[0] == 0
    before = snapshot(out)
    code, _, err = cli(capsys, out, cache_dir, '--test-nsteps', '3', '--resume', 'auto')
    assert code == 2 and err.count('\n') == 1
    assert f'the run in {out} completed without writing a checkpoint (--chkpt), so it cannot be trained further' in err
    assert snapshot(out) == before


def test_a_data_folder_with_other_classes_is_refused(completed, tmp_path, cache_dir, capsys):
    """As many classes, one named otherwise: the checkpoint's outputs would mean other labels (it
    resumed)."""
    import shutil
    data = tmp_path / 'data'
    shutil.copytree(os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0'), data)
    for split in ('train', 'val'):
        os.rename(data / split / 'n00000003', data / split / 'n00000009')
    out = copy_of(completed, tmp_path)
    before = snapshot(out)
    code, _, err = cli(capsys, out, cache_dir, '-e', '3', '--chkpt', '--resume', 'auto', '--data-dir', data)
    assert code == 2 and err.count('\n') == 1
    assert "was trained on other classes than this data's (class 3 is 'n00000003' there, 'n00000009' here)" in err
    assert snapshot(out) == before


# ------------------------------------------------------------------------------ found by review, each a test

def test_a_resume_takes_this_devices_kernels_not_the_checkpoints(tmp_path, cache_dir, monkeypatch):
    """A checkpoint written without fused kernels (on CPU) resumed where the optimizer is fused (a
    GPU): the optimizer keeps fused=True (load_state_dict brought back fused=None while the scaler
    still took the step for a fused one: 'Expected grad_scale and found_inf to be None' on the first
    fp16 step)."""
    from dlojzlib import recipe
    from dlojzlib.record.log import Console
    out = tmp_path / 'run'
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--test-nsteps', '2', '--chkpt']) == 0
    monkeypatch.setattr(recipe, 'build_optimizer', lambda args, model, lr, choice: torch.optim.SGD(
        recipe.param_groups(model, args.wd, args.wd_norm_bias), lr=lr, momentum=args.mom,
        fused=True))
    argv = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--test-nsteps', '4', '--resume', 'auto']
    args = flags.check_args(dlojz.get_args_parser().parse_args(argv), torch.device('cpu'))
    run, progress = dlojz.build_run(args, dlojz.get_dist_info(), torch.device('cpu'), Console(False))
    run.log.close()
    assert progress.global_step == 2 and all(g['fused'] is True for g in run.optimizer.param_groups)


def test_an_adamw_checkpoint_from_the_cpu_continues_fused_on_another_device():
    """AdamW written on the CPU (not fused: its step counts on the CPU), resumed where the optimizer
    is fused on another device ('meta' stands for the GPU: nothing runs on it; torch refuses
    fused=True there, so the flag is set as build_optimizer sets it on a GPU). torch's
    load_state_dict moves the moments to the parameters' device and leaves the steps on the CPU (the
    saved group was not fused): the fused kernel was then given CPU steps (a device mismatch; an
    illegal memory access with a tensor learning rate). Every state tensor must be on its
    parameter's device."""
    from dlojzlib.record import state
    torch.manual_seed(0)
    cpu = torch.nn.Linear(3, 2)
    written = torch.optim.AdamW(cpu.parameters())
    cpu(torch.randn(4, 3)).sum().backward()
    written.step()
    with torch.device('meta'):
        model = torch.nn.Linear(3, 2)
    here = torch.optim.AdamW(model.parameters())
    for group in here.param_groups:
        group['fused'] = True
    state.load_optimizer(here, written.state_dict())
    assert all(group['fused'] is True for group in here.param_groups)
    for p in model.parameters():
        moments = here.state[p]
        assert moments['exp_avg'].device == p.device and moments['exp_avg_sq'].device == p.device
        step = moments['step']
        assert step.device == p.device and step.dtype == torch.float32, step


def test_the_moments_take_the_layout_of_this_runs_parameters():
    """A checkpoint written with contiguous weights (a CPU or --no-channels-last run), resumed where
    the weights are channels-last: torch's load_state_dict kept the saved strides, and the fused
    AdamW on an H100 refused the step ("must have same dtype, device, and layout"; the CPU's fused
    kernel accepts them, so the strides are compared). Expected: each moment has its parameter's
    strides and its values."""
    from dlojzlib.record import state
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3)
    written = torch.optim.AdamW(conv.parameters())
    conv(torch.randn(2, 3, 8, 8)).sum().backward()
    written.step()
    saved = written.state_dict()
    here = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(here.parameters())
    state.load_optimizer(optimizer, saved)
    for p, before in zip(here.parameters(), saved['state'].values()):
        for key in ('exp_avg', 'exp_avg_sq'):
            moment = optimizer.state[p][key]
            assert moment.stride() == p.stride() and torch.equal(moment, before[key]), key
    assert here.weight.stride() != conv.weight.stride()  # the case is the one named


def test_the_momentum_follows_the_new_schedule(tmp_path, cache_dir, capsys):
    """onecycle -> cosine: the momentum is --mom again (it stayed frozen at the cycle's value of the
    resumed step, 0.86); under onecycle a changed --mom changes nothing (the cycle sets it), so that
    resume's losses are an uninterrupted run's bit for bit (its first resumed step took onecycle's
    0.95)."""
    out = tmp_path / 'run'
    assert cli(capsys, out, cache_dir, '--test-nsteps', '4', '--chkpt')[0] == 0
    assert cli(capsys, out, cache_dir, '--test-nsteps', '8', '--chkpt', '--resume', 'auto', '--scheduler',
               'cosine')[0] == 0
    assert torch.load(latest(out), map_location='cpu', weights_only=False)['optimizer']['param_groups'][0][
        'momentum'] == 0.9
    ref, resumed = tmp_path / 'ref', tmp_path / 'resumed'
    assert cli(capsys, ref, cache_dir, '--test-nsteps', '8')[0] == 0
    assert cli(capsys, resumed, cache_dir, '--test-nsteps', '4', '--chkpt')[0] == 0
    assert cli(capsys, resumed, cache_dir, '--test-nsteps', '8', '--resume', 'auto', '--mom', '0.8')[0] == 0
    assert [r['loss'] for r in records(resumed)] == [r['loss'] for r in records(ref)]


def test_a_completed_run_asked_the_same_end_by_other_flags_is_left_alone(completed, tmp_path, cache_dir, capsys,
                                                                        monkeypatch):
    """-e 2 ran 24 steps; --test-nsteps 24 -e 2 ends there too: the one line, nothing printed before
    it and nothing written, owner.json included (a new Slurm job rewrote it, after printing three
    lines)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs('runs')
    import shutil
    shutil.copytree(completed, 'runs/r')
    with open('runs/r/owner.json', 'w') as f:
        json.dump({'job_id': '111'}, f)
    before = snapshot('runs/r')
    monkeypatch.setenv('SLURM_JOB_ID', '222')
    code = dlojz.cli([*TINY, '--cache-dir', cache_dir, '--run-name', 'r', '--resume', 'auto', '-e', '2',
                      '--test-nsteps', '24', '--chkpt'])
    got = capsys.readouterr()
    assert code == 0 and got.out == '' and got.err.startswith('dlojz: the run in runs/r is complete (step 24')
    assert snapshot('runs/r') == before


def test_tune_is_refused_in_a_training_runs_folder_even_without_checkpoints(tmp_path, cache_dir, capsys):
    out = tmp_path / 'run'
    assert cli(capsys, out, cache_dir, '--test-nsteps', '2')[0] == 0
    before = snapshot(out)
    for length in ('2', '3'):
        code, _, err = cli(capsys, out, cache_dir, '--test-nsteps', length, '--resume', 'auto', '--tune',
                           '--tune-budget', '0.01')
        assert code == 2 and 'holds a training run; --tune writes its trials and record into a folder' in err, err
        assert snapshot(out) == before


def test_held_stderr_keeps_all_but_torchs_cpp_log(capfd):
    """What torch's C++ logs during the rendezvous goes when it fails; other lines stay (they were
    dropped)."""
    from dlojzlib.dist import launch
    cpp = (b'[W1125 01:40:35.694498078 TCPStore.cpp:340] [c10d] TCP client failed to connect\n'
           b'Exception raised from ping at TCPStore.cpp:427 (most recent call first):\n'
           b'frame #0: c10::Error::Error(...) + 0x9d\n<omitting python frames>\n\n')
    with pytest.raises(RuntimeError):
        with launch.cpp_errors_held():
            os.write(2, cpp + b'UserWarning: kept\n')
            raise RuntimeError('rendezvous failed')
    assert capfd.readouterr().err == 'UserWarning: kept\n'
    with launch.cpp_errors_held():
        os.write(2, cpp)
    assert capfd.readouterr().err == cpp.decode()

"""--shard (ZeRO 1, 2 and 3 on torch's own APIs), timm's models and the memory plan, on CPU with
gloo:

- every mode trains as DDP does: the same loss at every step and, bit for bit, the same weights,
  BatchNorm statistics and optimizer state at the end (2 ranks; 3 ranks within float32's rounding;
  the launches are in the long tier, the plan's arithmetic and the refusals in the fast one). The
  reference is a --shard none run of the same flags: DDP, which tests/test_ddp.py holds against a
  single-process loop;
- each rank's model states, counted from their storage after the first step, are the plan's, which
  is arithmetic over the parameters' shapes (dist.plan), within 1 %;
- under --shard gradients and full each rank writes its slices of a checkpoint into a
  torch.distributed.checkpoint folder, with rank 0's BatchNorm statistics (DDP's, bit for bit); a
  single process without sharding validates it as the 2 ranks did and resumes it where it resumes
  DDP's one-file checkpoint, 3 ranks under --shard full, one of them short of batches, validate it
  as one process does, and a resume at 3 ranks under --shard full ends where the same resume under
  --shard none ends; torch's dcp_to_torch_save makes it one file torchvision's scripts read;
- the plan by hand counts, its order over the modes (a property test), ViT-g on 4 GPUs, the refusal
  of a mode a GPU cannot hold, CoAtNet-7's parameter count on the meta device;
- every flag a sharded mode cannot take is refused in one sentence, and --shard full below torch 2.6
  (the floor stage of .ci/run runs that test);
- --arch timm:vit_tiny_patch16_224 trains, and resumes where an uninterrupted run is.

Run: python -m pytest -q -m "" tests/test_shard.py"""
import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import TINY, latest, run_cli, run_main, torchrun
import custom_models
import dlojz
from dlojzlib import flags
from dlojzlib.dist import plan
from dlojzlib.errors import UsageError
from dlojzlib.measure import memory
from dlojzlib.record.checkpoint import load_checkpoint

TORCH = tuple(int(v) for v in re.findall(r'\d+', torch.__version__)[:2])
FSDP = pytest.mark.skipif(TORCH < plan.FSDP_TORCH,
                          reason='FSDP2 runs on CPU from torch 2.6 (refused below)')
# the equivalence runs of tests/test_ddp.py: a small constant LR, so that rounding stays rounding
EQUIV = ['--test-nsteps', '4', '--lr', '0.002', '--scheduler', 'constant', '--wd', '0',
         '--log-interval', '1', '--chkpt']


def trained(tmp_path, cache, name, ranks, *flags_):
    out = tmp_path / name
    p = torchrun(ranks, *TINY, '--cache-dir', cache, '--output-dir', out, *EQUIV, *flags_)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out / 'summary.json') as f:
        summary = json.load(f)
    with open(out / 'metrics.jsonl') as f:
        losses = [r['loss'] for r in map(json.loads, f) if r.get('type') == 'train']
    # FSDP2's modes: a folder of each rank's slices; the others: one file
    assert latest(out).suffix == ('.dcp' if '--shard' in flags_ and flags_[
        flags_.index('--shard') + 1] in plan.FSDP_MODES else '.pt'), latest(out)
    return out, summary, losses, load_checkpoint(str(latest(out))), p.stdout


def assert_same_state(mine, ddp, rel=0.0):
    """Weights, BatchNorm buffers and optimizer state: equal, bit for bit (rel=0)."""
    same = (lambda a, b: torch.equal(a, b)) if not rel else \
        (lambda a, b: torch.allclose(a.double(), b.double(), rtol=rel, atol=rel))
    for k, v in ddp['model'].items():
        if isinstance(v, torch.Tensor):
            assert same(mine['model'][k], v), k
    assert mine['optimizer']['param_groups'] == ddp['optimizer']['param_groups']
    assert mine['optimizer']['state'].keys() == ddp['optimizer']['state'].keys()
    for i, s in ddp['optimizer']['state'].items():
        for k, v in s.items():
            assert same(mine['optimizer']['state'][i][k], v), (i, k)


def assert_states_planned(summary):
    m = summary['memory']
    assert m['model_state_bytes'] == pytest.approx(m['model_state_plan_bytes'], rel=0.01), m


def trains_as_ddp(tmp_path, cache, modes, ranks=2, *flags_):
    """FSDP2 reduces the gradients as (g_1 + ... + g_N) / N and DDP as g_1 / N + ... + g_N / N: the
    same bits where N is a power of two, within float32's rounding elsewhere (3 ranks: 8e-7 relative
    on a loss after 4 steps with AdamW)."""
    _, s0, losses0, ddp, _ = trained(tmp_path, cache, 'none', ranks, '--shard', 'none', *flags_)
    assert_states_planned(s0)
    for mode in modes:
        out, s, losses, mine, stdout = trained(tmp_path, cache, mode, ranks, '--shard', mode,
                                               *flags_)
        rel = 0.0 if mode == 'optimizer' or ranks & (ranks - 1) == 0 else 1e-5
        # a loss per step: 4, or the 3 an epoch holds at --accum-steps 2
        assert losses == pytest.approx(losses0, rel=rel, abs=0), (mode, losses, losses0)
        assert len(losses) == s0['global_step'] >= 3, (mode, losses)
        assert s['val']['loss'] == pytest.approx(s0['val']['loss'], rel=rel, abs=0), mode
        assert_same_state(mine, ddp, rel)
        assert_states_planned(s)
        assert '>>> Memory: model states per rank' in stdout, stdout
        assert f'(--shard {mode}, ' in stdout, stdout
    return s0


@pytest.mark.slow  # 20 s: two 2-rank launches, two resumes in this process
@FSDP
def test_full_sharding_trains_as_ddp_and_one_process_resumes_its_checkpoint(tmp_path, cache_dir):
    """trains_as_ddp holds the folder's BatchNorm statistics to DDP's, which are rank 0's (DDP
    broadcasts them): FSDP2's ranks each keep their own, and DCP keeps any one rank's copy."""
    s0 = trains_as_ddp(tmp_path, cache_dir, ['full'])
    # the 2 ranks' ZeRO-3 checkpoint, read by one process without sharding: the same validation
    s, _ = run_main(tmp_path / 'ev', cache_dir, '--resume', latest(tmp_path / 'full'), '--evaluate',
                    '-b', '16')
    # top-1 exactly; the loss to float32's rounding (its sum over the ranks adds in another order)
    assert s['val']['top1'] == s0['val']['top1']
    assert s['val']['loss'] == pytest.approx(s0['val']['loss'], rel=1e-6)
    # 2 -> 1: one process resumes the folder where it resumes DDP's file, bit for bit
    ends = []
    for mode in ('none', 'full'):
        run = tmp_path / f'one-{mode}'
        run_main(run, cache_dir, *EQUIV, '--resume', latest(tmp_path / mode), '--test-nsteps',
                 '6', '-b', '16')  # the 2 ranks' global batch
        ends.append(load_checkpoint(str(latest(run))))
    assert ends[0]['global_step'] == ends[1]['global_step'] == 6
    assert_same_state(ends[1], ends[0])
    assert not torch.equal(ends[1]['model']['fc.weight'],
                           load_checkpoint(str(latest(tmp_path / 'full')))['model']['fc.weight'])


@pytest.mark.slow
@FSDP
@pytest.mark.parametrize('ranks', [2, 3])
def test_every_mode_trains_as_ddp_with_adamw(tmp_path, cache_dir, ranks):
    trains_as_ddp(tmp_path, cache_dir, ['optimizer', 'gradients', 'full'], ranks,
                  '--optimizer', 'adamw', '--lr', '0.0005')


@pytest.mark.slow
@FSDP
@pytest.mark.parametrize('flag', [['--grad-checkpointing'], ['--accum-steps', '2']])
def test_full_sharding_takes_recomputation_and_accumulation_as_ddp_does(tmp_path, cache_dir, flag):
    trains_as_ddp(tmp_path, cache_dir, ['full'], 2, *flag)


@FSDP
def test_channels_last_is_off_by_default_where_fsdp2_slices_the_parameters():
    """FSDP2 refuses channels-last convolution weights ('does not support non-contiguous parameters
    yet', torch 2.14): on a GPU, where channels-last is the default, --shard gradients and full turn
    it off; DDP and ZeRO-1 keep it. (An H100's capability given: no GPU is asked.)"""
    for mode, on in (('none', True), ('optimizer', True), ('gradients', False), ('full', False)):
        args = flags.get_args_parser().parse_args(['--shard', mode, '--test-nsteps', '2', '--wandb',
                                                   'off'])
        args = flags.check_args(args, torch.device('cuda', 0), 1, capability=(9, 0))
        assert args.channels_last is on, mode


@pytest.mark.slow
def test_zero1_trains_as_ddp(tmp_path, cache_dir):
    """ZeRO-1 alone, which runs on the floor's torch too."""
    trains_as_ddp(tmp_path, cache_dir, ['optimizer'])


@pytest.mark.slow
@FSDP
def test_a_sharded_checkpoint_validates_and_resumes_at_another_world_size(tmp_path, cache_dir):
    """Written by 2 ranks under --shard full. 3 ranks validate 20 images in batches of 2 (4, 4 and 3
    batches: the third rank runs a blank forward in step with the others) as one process does; a
    resume at 3 ranks under --shard full ends where the same resume under --shard none (DDP) ends.
    """
    out = trained(tmp_path, cache_dir, 'full', 2, '--shard', 'full')[0]
    ckpt = latest(out)
    val = ['--synthetic-val-per-class', '5', '--val-batch-size', '2']
    one, _ = run_main(tmp_path / 'ev1', cache_dir, '--resume', ckpt, '--evaluate', *val)
    p = torchrun(3, *TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'ev3', '--resume',
                 ckpt, '--evaluate', '--shard', 'full', *val)
    assert p.returncode == 0, p.stderr[-3000:]
    three = json.load(open(tmp_path / 'ev3' / 'summary.json'))
    assert (three['val']['top1'], three['val']['batches']) == (one['val']['top1'], 4), \
        (three['val'], one['val'])
    assert three['val']['loss'] == pytest.approx(one['val']['loss'], rel=1e-6)
    ends = {}
    for mode in ('none', 'full'):
        run = tmp_path / f'resumed-{mode}'
        p = torchrun(3, *TINY, '--cache-dir', cache_dir, '--output-dir', run, *EQUIV, '--resume',
                     ckpt, '--test-nsteps', '8', '--allow-batch-change', '--shard', mode)
        assert p.returncode == 0, p.stderr[-3000:]
        ends[mode] = load_checkpoint(str(latest(run)))
    # resumed at image 64: step 2 of the 4 steps of 24 images an epoch holds
    assert ends['full']['global_step'] == 4
    # 3 ranks: trains_as_ddp says why not bit for bit
    assert_same_state(ends['full'], ends['none'], rel=1e-5)
    written = load_checkpoint(str(ckpt))['model']['fc.weight']
    assert not torch.equal(ends['full']['model']['fc.weight'], written)


def _checkpointing_rank(rank, port, folder, result):
    """A rank of 2 (gloo) saving sharded checkpoints of a sliced Conv-BatchNorm-Linear model whose
    BatchNorm statistics differ per rank (rank + 1), as FSDP2's do: one that writes, one whose
    rank 1 finds its disk full in a tensor's data (inside torch.save, whose zip writer turns the
    OSError into 'unexpected pos'), one pruned to the newest, best.dcp written twice. The head is
    large (1000 outputs: 288 KB of weights a rank) for torch.save to write its data as it goes."""
    import contextlib
    import errno

    from torch.distributed.fsdp import fully_shard

    from dlojzlib.dist import launch, shard
    from dlojzlib.dist.launch import DistInfo
    from dlojzlib.errors import DiskFull
    from dlojzlib.record.checkpoint import checkpoint_path, save_sharded_checkpoint
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    launch.setup(DistInfo(rank=rank, world_size=2, local_world_size=2, master_port=port,
                          launcher='torchrun'), torch.device('cpu'))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 1000))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    model[1].running_mean.fill_(rank + 1.0)
    slices = shard.sharded_state(model, optimizer)
    said = {'saved': slices['model']['1.running_mean'].tolist(),
            'own': model[1].running_mean.tolist()}
    rest = {'global_step': 1} if rank == 0 else None
    save_sharded_checkpoint(checkpoint_path(folder, 1, True), slices, rest, 2, rank == 0)
    if rank == 1:  # the next write fills rank 1's disk after 1000 bytes, inside torch.save
        from torch.distributed.checkpoint.filesystem import FileSystem

        class Filling:  # the first large write (a tensor's data, inside torch.save) fails; the
            def __init__(self, f):  # small ones after it fit in the file's buffer, as they may
                self.f, self.full = f, False

            def write(self, b):
                if len(b) >= 100_000 and not self.full:
                    self.full = True
                    raise OSError(errno.ENOSPC, 'No space left on device')
                return self.f.write(b)

            def __getattr__(self, name):
                return getattr(self.f, name)
        real = FileSystem.create_stream

        @contextlib.contextmanager
        def filling(self, path, mode):
            with real(self, path, mode) as stream:
                yield Filling(stream) if 'w' in mode else stream
        FileSystem.create_stream = filling
    try:
        save_sharded_checkpoint(checkpoint_path(folder, 2, True), slices, rest, 2, rank == 0)
        said['full'] = 'written'
    except DiskFull as e:
        said['full'] = str(e)
    if rank == 1:
        FileSystem.create_stream = real
    said['after_full'] = sorted(os.listdir(folder))
    for step in (3, 4):
        save_sharded_checkpoint(checkpoint_path(folder, step, True), slices, rest, 2, rank == 0)
    for _ in range(2):
        save_sharded_checkpoint(os.path.join(folder, 'best.dcp'), slices, rest, None, rank == 0)
    launch.cleanup()
    result.put((rank, said))


@FSDP
@pytest.mark.slow  # 8 s: 2 spawned ranks
def test_a_sharded_checkpoint_keeps_rank_0s_statistics_and_survives_a_full_disk(tmp_path):
    """The folder holds rank 0's BatchNorm statistics whatever copy DCP keeps, and each rank's own
    stay its own. A full disk on rank 1 is DiskFull's sentence on both ranks and leaves the
    previous checkpoint and no partial folder; --keep-checkpoints prunes folders; best.dcp is
    replaced."""
    import multiprocessing as mp

    from conftest import free_port
    ctx = mp.get_context('spawn')
    result, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_checkpointing_rank, args=(r, port, str(tmp_path), result))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        said = dict(result.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            p.kill()
    for rank in (0, 1):
        assert said[rank]['saved'] == [1.0] * 4, said
        assert said[rank]['own'] == [rank + 1.0] * 4, said
        assert said[rank]['full'].startswith('no space left on'), said[rank]['full']
        assert 'checkpoint-00000002.dcp;' in said[rank]['full'], said[rank]['full']
    assert said[0]['after_full'] == ['checkpoint-00000001.dcp'], said[0]
    assert sorted(os.listdir(tmp_path)) == ['best.dcp', 'checkpoint-00000003.dcp',
                                            'checkpoint-00000004.dcp']
    for name in ('best.dcp', 'checkpoint-00000004.dcp'):
        read = load_checkpoint(str(tmp_path / name))
        assert read['global_step'] == 1
        assert read['model']['1.running_mean'].tolist() == [1.0] * 4
        assert read['optimizer']['state'][0]['exp_avg'].shape == (4, 3, 3, 3)
    # docs/sharding.md's conversion for torchvision's scripts, and torch.load's default reads it
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.checkpoint.format_utils',
                        'dcp_to_torch', str(tmp_path / 'best.dcp'), str(tmp_path / 'model.pt')],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    fresh = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 1000))
    fresh.load_state_dict(torch.load(tmp_path / 'model.pt')['model'])
    assert fresh[1].running_mean.tolist() == [1.0] * 4


def _params_in_groups(sizes):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(sum(sizes))]
    groups, at = [], 0
    for n in sizes:
        groups.append({'params': params[at:at + n], 'lr': 0.1 * (len(groups) + 1)})
        at += n
    return params, groups


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_an_optimizer_state_by_name_loads_where_torch_puts_each_parameter(sizes, data):
    """DCP keys the optimizer's state by parameter name; by_index puts it in torch's one-process
    form. torch's own load_state_dict, given the result, must put each name's state on the
    parameter of that name, in any groups, with any parameters still without state."""
    from dlojzlib.record.checkpoint import by_index
    params, groups = _params_in_groups(sizes)
    names = data.draw(st.permutations([f'layer{i}.weight' for i in range(len(params))]))
    of = dict(zip(names, params))
    stateful = data.draw(st.sets(st.sampled_from(names)))
    named = {'state': {n: {'momentum_buffer': torch.full((2,), float(i))}
                       for i, n in enumerate(names) if n in stateful},
             'param_groups': [{'lr': g['lr'], 'momentum': 0.9, 'dampening': 0,
                               'weight_decay': 0, 'nesterov': False, 'maximize': False,
                               'foreach': None, 'differentiable': False, 'fused': None,
                               'params': [n for q in g['params'] for n in names
                                          if of[n] is q]}
                              for g in groups]}
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    optimizer.load_state_dict(by_index(named))
    for name, p in of.items():
        got = optimizer.state.get(p, {}).get('momentum_buffer')
        want = named['state'].get(name, {}).get('momentum_buffer')
        assert (got is None and want is None) or torch.equal(got, want), name
    assert [g['lr'] for g in optimizer.param_groups] == [g['lr'] for g in groups]


@pytest.fixture(scope='module')
def dcp_folder(tmp_path_factory):
    """A sharded checkpoint written by one process: what load_sharded_checkpoint reads."""
    import warnings

    from dlojzlib.record.checkpoint import save_sharded_checkpoint
    folder = tmp_path_factory.mktemp('dcp') / 'checkpoint-00000003.dcp'
    slices = {'model': {'w': torch.arange(12.0).reshape(3, 4), 'b': torch.ones(3)},
              'optimizer': {'state': {'w': {'exp_avg': torch.full((3, 4), 2.0)}},
                            'param_groups': [{'lr': 0.5, 'params': ['w', 'b']}]}}
    with warnings.catch_warnings():  # 'no process group': one process is what is asked
        warnings.simplefilter('ignore')
        save_sharded_checkpoint(str(folder), slices, {'global_step': 3, 'args': {'arch': 'x'}})
    return folder


def test_an_optimizer_without_state_round_trips(tmp_path):
    """SGD without momentum keeps no state: DCP, which saves leaves only, gives back no 'state' at
    all; the checkpoint still reads, its state empty."""
    import warnings

    from dlojzlib.record.checkpoint import load_checkpoint, save_sharded_checkpoint
    folder = tmp_path / 'checkpoint-00000001.dcp'
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    named = {'state': {}, 'param_groups': [{**optimizer.state_dict()['param_groups'][0],
                                            'params': ['w']}]}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        save_sharded_checkpoint(str(folder), {'model': {'w': torch.ones(2)}, 'optimizer': named},
                                {'global_step': 1})
    read = load_checkpoint(str(folder))['optimizer']
    assert read['state'] == {} and read['param_groups'][0]['params'] == [0]
    optimizer.load_state_dict(read)


def test_ctrl_c_while_a_sharded_checkpoint_is_read_is_an_interrupt(dcp_folder, monkeypatch):
    """DCP wraps whatever its reader raises, a KeyboardInterrupt too, in a CheckpointException:
    Ctrl-C during --resume auto's read was taken for a damaged checkpoint, and the previous one was
    resumed in its place."""
    from torch.distributed.checkpoint import FileSystemReader

    from dlojzlib.record.checkpoint import load_checkpoint

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(FileSystemReader, 'read_data', interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(str(dcp_folder))


def test_a_sharded_checkpoint_named_with_a_trailing_slash_is_the_folder(dcp_folder):
    """A shell completes a folder's name with '/': the run still knows the checkpoint is in its
    own folder (a resume there cuts metrics.jsonl back to it)."""
    from dlojzlib.record.state import find_resume_checkpoint
    path, ckpt = find_resume_checkpoint(argparse.Namespace(resume=f'{dcp_folder}/'), None, print)
    assert path == str(dcp_folder) and ckpt['global_step'] == 3


def test_a_sharded_checkpoint_a_kill_left_half_written_is_removed_and_not_resumed(tmp_path,
                                                                                   monkeypatch):
    """Killed after DCP wrote its files and before the rename: the temporary folder is not a
    checkpoint, and the next run's start removes it (as it removes a half-written .pt)."""
    import warnings

    from dlojzlib.record import checkpoint
    monkeypatch.setattr(checkpoint, '_publish', lambda *a: None)  # the kill, just before it
    for name in ('checkpoint-00000004.dcp', 'best.dcp'):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            checkpoint.save_sharded_checkpoint(str(tmp_path / name), {'model': {}}, {'x': 1})
    assert len(os.listdir(tmp_path)) == 2 and checkpoint.list_checkpoints(str(tmp_path)) == []
    said = []
    checkpoint.remove_partial_checkpoints(str(tmp_path), said.append)
    assert os.listdir(tmp_path) == [] and 'Removed 2 partial checkpoint' in said[0], said


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_damaged_sharded_checkpoint_is_one_sentence_or_reads_whole(dcp_folder, tmp_path_factory,
                                                                    data):
    """A folder a crash or a copy damaged (a file cut short, a file missing): the reader says so in
    one sentence (UsageError), or it reads the checkpoint as written, never anything else."""
    import shutil

    from dlojzlib.record.checkpoint import load_checkpoint
    copy = tmp_path_factory.mktemp('damaged') / dcp_folder.name
    shutil.copytree(dcp_folder, copy)
    name = data.draw(st.sampled_from(sorted(os.listdir(copy))))
    if data.draw(st.booleans()):
        os.remove(copy / name)
    else:
        size = os.path.getsize(copy / name)
        with open(copy / name, 'r+b') as f:
            f.truncate(data.draw(st.integers(0, max(size - 1, 0))))
    try:
        read = load_checkpoint(str(copy))
    except UsageError as e:
        assert 'cannot be read' in str(e) and str(copy) in str(e)
        return
    assert read['global_step'] == 3 and torch.equal(read['model']['w'],
                                                     torch.arange(12.0).reshape(3, 4))
    assert torch.equal(read['optimizer']['state'][0]['exp_avg'], torch.full((3, 4), 2.0))


# ----------------------------------------------------------------------------------------- the plan

def test_the_plan_by_hand():
    """Two tensors, (4, 3) and (3,): 15 elements of 4 bytes. SGD with momentum keeps one buffer per
    parameter, AdamW two and a 4-byte step each. At 2 ranks FSDP2 gives rank 0 rows 0-1 of the first
    (6 elements) and elements 0-1 of the second (2): 8."""
    groups = [[(4, 3), (3,)]]
    none = plan.plan(groups, 'none', 2, 'sgd')
    assert (none['parameters'], none['gradients'], none['optimizer']) == (60, 60, 60)
    full = plan.plan(groups, 'full', 2, 'adamw', blocks=[[(4, 3)], [(3,)]])
    assert (full['parameters'], full['optimizer'], full['gathered']) == (32, 2 * 32 + 2 * 4, 60)
    # ZeRO-1: 12 elements to rank 0, 3 to rank 1; the plan counts rank 0's
    assert plan.plan(groups, 'optimizer', 2, 'sgd')['optimizer'] == 48
    assert plan.zero_partition([[10, 6, 5]], 2) == [10, 11]
    assert plan.plan(groups, 'full', 1, 'sgd', momentum=0)['optimizer'] == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1,
                         max_size=6), min_size=1, max_size=3),
       st.integers(1, 9), st.sampled_from(sorted(plan.STATE)))
def test_each_mode_keeps_no_more_than_the_one_before(groups, world, optimizer):
    groups = [[tuple(s) for s in g] for g in groups]
    p = plan.plans(groups, world, optimizer)
    whole = sum(torch.Size(s).numel() for g in groups for s in g) * 4
    assert p['none']['parameters'] == whole
    # not ZeRO-1 against FSDP2: a dimension shorter than the world leaves whole rows on rank 0
    assert p['none']['model_states'] >= p['optimizer']['model_states']
    assert p['none']['model_states'] >= p['gradients']['model_states'] == p['full']['model_states']
    assert whole <= world * p['full']['parameters'] < whole + world * 4 * sum(
        torch.Size(s[1:]).numel() for g in groups for s in g)


def plan_args(**kw):
    base = dict(wd=0.0, wd_norm_bias=True, optimizer='adamw', mom=0.9, shard='none',
                cpu_offload=False, arch='timm:vit_giant_patch14_224')
    return argparse.Namespace(**{**base, **kw})


def on_meta(arch):
    """The model built on the meta device; skipped where this timm computes values while it builds
    (timm 1.0.3 does: dlojz then runs without a plan,
    test_a_model_the_meta_device_cannot_build_runs_without_a_plan)."""
    try:
        with torch.device('meta'):
            return custom_models.build_model(arch, 1000)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f'this timm cannot build {arch} on the meta device: {e}')


def test_vit_g_fits_16_gb_gpus_only_when_sharded():
    """ViT-g/14 (1.01 B parameters) with AdamW: 16.2 GB of model states under DDP, 4.1 GB per GPU
    under ZeRO-3 on 4 GPUs. On a 16 GB GPU, DDP is refused and the refusal names ZeRO-1 (10.1 GB).
    """
    meta = on_meta('timm:vit_giant_patch14_224')
    blocks = custom_models.blocks(meta)
    assert len(blocks) == 40
    plans = memory.plan_model(plan_args(shard='full'), meta, blocks, 4, capacity=16e9)
    assert plans['full']['model_states'] <= 4.1e9 and plans['none']['model_states'] >= 16.1e9, plans
    refused = r'needs 15\.\d\d GiB .* under --shard none .* --shard optimizer'
    with pytest.raises(UsageError, match=refused):
        memory.plan_model(plan_args(), meta, blocks, 4, capacity=16e9)


def test_a_model_the_meta_device_cannot_build_runs_without_a_plan():
    said = []

    def build():
        torch.linspace(0, 1, 3)[1].item()  # what timm 1.0.3's ViT does for its drop-path rates
    assert memory.plan_run(plan_args(), build, custom_models.blocks, 2, say=said.append) is None
    assert len(said) == 1 and said[0].startswith('Memory plan: not made') and 'meta' in said[0]
    measured = {'parameters': 4, 'gradients': 4, 'optimizer': 8, 'model_states': 16}
    line = memory.line(memory.summary(None, 'none', measured), 'none', 2)
    assert line.startswith('>>> Memory: model states per rank 0.00 GiB measured'), line
    assert 'no plan' in line


def test_coatnet7_has_the_papers_parameter_count():
    model = on_meta('coatnet7')
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 2.44e9) / 2.44e9 < 0.02, n
    assert len(custom_models.blocks(model)) == 2 + 4 + 8 + 42 + 2


# ----------------------------------------------------------------------------------------- refusals

def checked(*argv, device='cpu', world=2):
    args = flags.get_args_parser().parse_args(['--test-nsteps', '2', '--wandb', 'off', *argv])
    return flags.check_args(args, torch.device(device), world)


@pytest.mark.parametrize('argv, says', [
    (['--cpu-offload'], '--cpu-offload keeps the shards of --shard gradients or full'),
    (['--shard', 'full', '--ema-decay', '0.99'], 'drop --ema-decay'),
    (['--shard', 'gradients', '--arch', 'resnet18-heads'], 'leaves its unused heads'),
    (['--shard', 'full', '--compile'], 'drop --compile'),
    (['--shard', 'full', '--sync-bn'], 'use --shard optimizer with --sync-bn'),
    (['--shard', 'gradients', '--channels-last'], 'drop --channels-last'),
    (['--shard', 'full', '--amp', 'fp16'], 'use --amp bf16'),
    (['--arch', 'timm:no_such_model'], "timm has no model 'no_such_model'"),
    (['--arch', 'timm:vit_tiny_patch16_224', '--val-image-size', '48'], 'built for one image size'),
])
def test_what_a_mode_cannot_take_is_refused_in_one_sentence(argv, says):
    with pytest.raises(UsageError, match=re.escape(says)) as e:
        checked(*argv)
    assert '\n' not in str(e.value) and str(e.value).endswith('.')


def test_fsdp_is_refused_below_torch_2_6_and_where_gloo_would_carry_gpu_slices():
    args = flags.check_flags(flags.get_args_parser().parse_args(['--shard', 'full']))
    sentences = [s for refused, s in plan.refusals(args, 'cpu', 2, (2, 4)) if refused]
    assert sentences == ['--shard full needs FSDP2\'s fully_shard, public from torch 2.6 (this is '
                         '2.4); use --shard optimizer (ZeRO-1) or upgrade torch.']
    gloo = plan.refusals(args, 'cuda', 2, (2, 14), backend='gloo')
    assert any(r and 'gloo' in s for r, s in gloo)


@pytest.mark.skipif(TORCH >= plan.FSDP_TORCH,
                    reason='the floor stage: torch below 2.6 refuses --shard full')
def test_the_floor_refuses_full_sharding(tmp_path):
    p = run_cli(*TINY, '--output-dir', tmp_path / 'run', '--shard', 'full', '--test-nsteps', '1')
    assert p.returncode == 2 and 'public from torch 2.6' in p.stderr, p.stderr
    assert 'Traceback' not in p.stderr, p.stderr


# --------------------------------------------------------------------------------------------- timm

def test_a_timm_vit_trains_and_resumes_where_an_uninterrupted_run_is(tmp_path, cache_dir):
    vit = ['--arch', 'timm:vit_tiny_patch16_224', '--optimizer', 'adamw', '--lr', '0.0005',
           '--chkpt', '--scheduler', 'constant']
    whole, _ = run_main(tmp_path / 'whole', cache_dir, *vit, '--test-nsteps', '4')
    run_main(tmp_path / 'cut', cache_dir, *vit, '--test-nsteps', '2')
    resumed, records = run_main(tmp_path / 'cut', cache_dir, *vit, '--test-nsteps', '4', '--resume',
                                'auto')
    assert any(r['type'] == 'resume' for r in records) and resumed['global_step'] == 4
    a, b = (torch.load(latest(tmp_path / d), weights_only=False) for d in ('whole', 'cut'))
    assert a['global_step'] == b['global_step'] == 4
    assert_same_state(b, a)
    assert resumed['val']['loss'] == whole['val']['loss']

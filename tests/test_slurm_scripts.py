"""slurm/: the shipped scripts are exactly what tools.slurm renders (one source of truth), every
#SBATCH line says why, one task per GPU, flags forwarded, and the submit helper's dry run, shape
rules and help.

Run: python -m pytest -q tests/test_slurm_scripts.py"""
import os
import re
import subprocess

import pytest

from conftest import ROOT
from dlojzlib.dist import machines
from dlojzlib.tools import slurm as S


@pytest.mark.parametrize('machine,gpus,ranks', S.SHIPPED)
def test_shipped_script_is_the_generator_output(machine, gpus, ranks):
    path = os.path.join(ROOT, 'slurm', S.script_name(machine, gpus, ranks))
    with open(path) as f:
        assert f.read() == S.render(machine, gpus, ranks_per_gpu=ranks), f'{path} is stale: run python ' \
                                                                           'dlojz_slurm.py --write'


def test_no_stale_script_is_left_in_slurm():
    names = {n for n in os.listdir(os.path.join(ROOT, 'slurm')) if n.endswith('.slurm')}
    assert names == {S.script_name(m, g, r) for m, g, r in S.SHIPPED} | \
        {S.script_name(m, g, recipe=r) for m, g, r in S.SHIPPED_RECIPES + S.SHIPPED_PROGRAMS}


@pytest.mark.parametrize('machine,gpus,recipe', S.SHIPPED_RECIPES)
def test_a_recipe_script_runs_its_flags_and_says_its_plan(machine, gpus, recipe):
    """The course's fourth day: the shipped file is the generator's, its flags come before the
    user's (which win), its run has a name of its own, and the plan in its comments is the one dlojz
    prints: recomputed here from CoAtNet-7 built on the meta device."""
    import argparse
    import torch
    import custom_models
    from dlojzlib.measure import memory
    path = os.path.join(ROOT, 'slurm', S.script_name(machine, gpus, recipe=recipe))
    text = S.render(machine, gpus, recipe=recipe)
    assert open(path).read() == text, f'{path} is stale: run python dlojz_slurm.py --write'
    srun = text[text.index('srun python'):text.index('"$@" &')]
    assert all(f'    {flag} \\\n' in srun for flag in S.RECIPES[recipe]['flags'])
    assert f'--job-name=dlojz-{S.script_name(machine, gpus, recipe=recipe)[:-6]} ' in text
    flags = dict(f.split(' ', 1) for f in S.RECIPES[recipe]['flags'])
    args = argparse.Namespace(wd=0.0, wd_norm_bias=True, optimizer=flags['--optimizer'], mom=0.9,
                              shard='full', cpu_offload=False, arch=flags['--arch'])
    with torch.device('meta'):
        model = custom_models.build_model(flags['--arch'], 1000)
    plans = memory.plan_model(args, model, custom_models.blocks(model), gpus)
    said = dict(re.findall(r'--shard (\w+) (\d+(?:\.\d+)?)', text.split('#SBATCH')[0]))
    gb = lambda p: f"{p['model_states'] / 1e9:.1f}".rstrip('0').rstrip('.')  # as the comments say
    assert said == {m: gb(p) for m, p in plans.items()}


@pytest.mark.parametrize('machine,gpus,program', S.SHIPPED_PROGRAMS)
def test_a_program_script_is_the_generator_output_and_runs_its_program(machine, gpus, program):
    """The JSC course's Lightning script: the site's set-up and shape, its own program under srun
    with the user's flags, and none of dlojz.py's (it has no --resume or --run-name)."""
    name = S.script_name(machine, gpus, recipe=program)
    text = open(os.path.join(ROOT, 'slurm', name)).read()
    assert text == S.render(machine, gpus, recipe=program), f'{name} is stale: run python ' \
                                                            'dlojz_slurm.py --write'
    srun = text[text.index('srun python'):text.index('"$@" &')]
    assert srun == f'srun python -u {S.RECIPES[program]["program"]} \\\n    '
    assert os.path.exists(os.path.join(ROOT, S.RECIPES[program]['program']))
    assert text.count(f'--ntasks-per-node={gpus} ') == 1 and f'--gres=gpu:{gpus} ' in text
    assert 'module load Stages/2025' in text and 'RUN_NAME' not in text


def test_a_recipe_is_refused_at_a_size_it_is_not_planned_for(capsys):
    assert S.main(['--machine', 'h100', '--gpus', '1', '--recipe', 'coatnet7', '--dry-run']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'planned for [4, 8] GPUs, not --gpus 1' in err


@pytest.mark.parametrize('machine,gpus,ranks', S.SHIPPED)
def test_script_shape_and_comments(machine, gpus, ranks):
    text = S.render(machine, gpus, ranks_per_gpu=ranks)
    sbatch = [line for line in text.splitlines() if line.startswith('#SBATCH')]
    assert all(re.search(r'\S\s+# \S', line) for line in sbatch), 'every #SBATCH line carries a comment'
    opts = dict(re.match(r'#SBATCH --([\w-]+)=?(\S*)', line).groups() for line in sbatch)
    nodes, per_node = int(opts['nodes']), int(opts['ntasks-per-node'])
    if machine != 'cpu':
        request = opts.get('gres') or opts['gpus-per-node']
        gpus_per_node = int(request.split(':')[-1])
        assert per_node == ranks * gpus_per_node and nodes * gpus_per_node == gpus  # `ranks` tasks per GPU
        assert gpus_per_node <= S.MACHINES[machine]['gpus_per_node']
    assert opts['signal'] == 'USR2@120' and 'requeue' in opts
    assert ('hint' in opts) == (S.MACHINES[machine]['site'] in ('jz', 'generic', 'cpu'))
    assert opts['output'] == f'slurm/log/%x_%j_{nodes}nodes_{nodes * per_node}tasks.out'
    assert 'srun python -u dlojz.py \\' in text and '    "$@" &\n' in text and text.rstrip().endswith('exit $code')
    assert '--resume auto' in text and 'ADAPT' in text
    if S.MACHINES[machine]['site'] == 'jz':
        assert f'--constraint={S.MACHINES[machine]["constraint"]}' in text and 'module load' in text


def test_expected_scripts_exist():
    names = sorted(os.listdir(os.path.join(ROOT, 'slurm')))
    for n in ('cpu.slurm', 'generic-4gpu.slurm', 'jz-v100-1gpu.slurm', 'jz-v100-4gpu.slurm', 'jz-v100-8gpu.slurm',
              'jz-a100-1gpu.slurm', 'jz-a100-8gpu.slurm', 'jz-a100-16gpu.slurm', 'jz-h100-1gpu.slurm',
              'jz-h100-4gpu.slurm', 'jz-h100-8gpu.slurm', 'ac-narval-1gpu.slurm', 'ac-narval-4gpu.slurm',
              'ac-narval-8gpu.slurm', 'ac-narval-1gpu-mps4.slurm', 'jsc-booster-1gpu.slurm',
              'jsc-booster-4gpu.slurm', 'jsc-booster-8gpu.slurm'):
        assert n in names


@pytest.mark.parametrize('machine, qos', [('v100', 'qos_gpu-dev'), ('a100', 'qos_gpu_a100-dev'),
                                         ('h100', 'qos_gpu_h100-dev')])
def test_jean_zay_scripts_name_their_partition_qos(machine, qos):
    text = S.render(machine, S.MACHINES[machine]['gpus_per_node'])
    assert f'##SBATCH --qos={qos} ' in text


def test_tasks_get_their_cores_and_the_header_says_how_to_remake_it():
    """srun >= 22.05 does not pass --cpus-per-task on: the scripts export SRUN_CPUS_PER_TASK before
    srun. The header gives the command that renders the script (shapes with no file in slurm/
    included)."""
    text = S.render('a100', 32, '04:00:00', account='abc@a100', qos='qos_gpu_a100-t4', partition='gpu_p5')
    lines = text.splitlines()
    assert lines.index('export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK') < lines.index('srun python -u dlojz.py \\')
    made = next(line for line in lines if line.startswith('# Made by: '))[len('# Made by: '):]
    args = made.split()[2:]  # after 'python dlojz_slurm.py'
    assert args[-1] == '--dry-run'
    assert S.render(*S.parse(args[:-1])) == text
    for opt in ('--account=abc@a100 ', '--qos=qos_gpu_a100-t4 ', '--partition=gpu_p5 ', '--time=04:00:00 '):
        assert f'#SBATCH {opt}' in text, opt


def test_helper_dry_run_and_shape_errors(capsys):
    assert S.main(['--machine', 'a100', '--gpus', '16', '--dry-run', '--', '--amp', 'bf16']) == 0
    out = capsys.readouterr().out
    assert out.startswith(S.render('a100', 16)) and out.rstrip().endswith('sbatch <this script> --amp bf16')
    assert S.main(['--machine', 'v100', '--gpus', '6', '--dry-run']) == 2
    assert 'a multiple of it' in capsys.readouterr().err
    assert S.shape('v100', 2) == (1, 2) and S.shape('h100', 12) == (3, 4)
    assert S.main(['--machine', 'a100', '--gpus', '0', '--dry-run']) == 2
    assert capsys.readouterr().err == ('dlojz_slurm: error: --gpus 0: ask for at least 1 GPU (--machine cpu runs '
                                       'without any).\n')


def test_helper_help_is_whole(capsys):
    """The description was the docstring's first line, cut mid-sentence; the examples follow it now."""
    with pytest.raises(SystemExit) as e:
        S.main(['--help'])
    out = capsys.readouterr().out
    assert e.value.code == 0 and 'from one source (in the spirit of the course\'s gpu_jobs_submitter).' in out
    assert 'python dlojz_slurm.py --write' in out and 'a100: Jean Zay A100' in out


def _srun_argv(tmp_path, script, *flags, **env):
    """Run a shipped script with bash, `srun` replaced by a shim that prints the dlojz flags it was
    given."""
    shims = tmp_path / 'bin'
    shims.mkdir(exist_ok=True)
    (shims / 'srun').write_text('#!/bin/sh\nshift 3\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')  # drops python -u dlojz.py
    (shims / 'module').write_text('#!/bin/sh\nexit 0\n')
    (shims / 'activate').write_text('')
    for f in ('srun', 'module'):
        (shims / f).chmod(0o755)
    r = subprocess.run(['bash', os.path.join(ROOT, 'slurm', script), *flags], capture_output=True, text=True,
                       env={'PATH': f'{shims}:/usr/bin:/bin', 'DLOJZ_VENV': str(tmp_path), 'SLURM_JOB_ID': '77',
                            'SLURM_JOB_NAME': 'dlojz-cpu', 'SLURM_CPUS_PER_TASK': '2', **env}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _run_name(argv):
    return argv[argv.index('--run-name') + 1] if '--run-name' in argv else None


@pytest.mark.parametrize('script', ['cpu.slurm', 'jz-h100-4gpu.slurm'])
def test_a_resubmitted_script_names_the_same_run(tmp_path, script):
    """The run folder does not depend on the job id: the same flags give the same --run-name in
    another job, other flags another one; DLOJZ_RUN chooses it; an --output-dir among the flags
    wins."""
    first = _srun_argv(tmp_path, script, '-b', '64', '--amp', 'bf16')
    again = _srun_argv(tmp_path, script, '-b', '64', '--amp', 'bf16', SLURM_JOB_ID='78')
    other = _srun_argv(tmp_path, script, '-b', '128', '--amp', 'bf16', SLURM_JOB_ID='79')
    assert _run_name(first) == _run_name(again) and _run_name(first).startswith('dlojz-cpu-')
    assert _run_name(other) != _run_name(first)
    assert first[-4:] == ['-b', '64', '--amp', 'bf16'] and '--resume' in first
    assert _run_name(_srun_argv(tmp_path, script, '-b', '64', DLOJZ_RUN='my run')) == 'my run'
    arrays = {_run_name(_srun_argv(tmp_path, script, '-b', '64', SLURM_ARRAY_TASK_ID=t)) for t in '01'}
    assert len(arrays) == 2 and _run_name(first) not in arrays  # job array tasks: a run each
    readme = _srun_argv(tmp_path, 'jz-a100-8gpu.slurm', '--test-nsteps', '50', '--amp', 'bf16', '-b', '256',
                        SLURM_JOB_NAME='dlojz-jz-a100-8gpu')
    with open(os.path.join(ROOT, 'README.md')) as f:
        assert f'runs/{_run_name(readme)}/' in f.read()  # the README's example is what the script computes
    for given in (['--output-dir', 'runs/x'], ['--output-dir=runs/x']):
        assert _run_name(_srun_argv(tmp_path, script, *given)) is None


def test_the_batch_shell_passes_sigusr2_on_and_keeps_sruns_exit_code(tmp_path):
    """A SIGUSR2 for the batch shell alone reaches srun (here a stand-in that checkpoints: exits 5
    on it), and the job ends with srun's exit code, not the shell's interrupted wait (140)."""
    shims = tmp_path / 'bin'
    shims.mkdir()
    (shims / 'srun').write_text('#!/bin/bash\ntrap \'echo got >> "$MARK"; exit 5\' USR2\n'
                                'sleep 30 & wait\nexit 0\n')
    (shims / 'srun').chmod(0o755)
    (tmp_path / 'activate').write_text('')
    env = {'PATH': f'{shims}:/usr/bin:/bin', 'DLOJZ_VENV': str(tmp_path), 'SLURM_JOB_NAME': 'dlojz-cpu',
           'MARK': str(tmp_path / 'mark')}
    p = subprocess.Popen(['bash', os.path.join(ROOT, 'slurm', 'cpu.slurm')], env=env, cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import signal
    import time
    time.sleep(1.0)  # the shell is waiting for srun
    p.send_signal(signal.SIGUSR2)
    assert p.wait(timeout=20) == 5
    assert (tmp_path / 'mark').read_text() == 'got\n'


def docs_sites_table():
    """The rows of docs/slurm.md's Sites table -> {(machine, partition): {column: value}}."""
    with open(os.path.join(ROOT, 'docs', 'slurm.md')) as f:
        text = f.read()
    section = text[text.index('\n## Sites\n'):]
    lines = [ln for ln in section.splitlines() if ln.startswith('| `') and not ln.startswith('| `--machine`')]
    cols = ['machine', 'nodes', 'gpus', 'cpus', 'mem', 'request', 'partition', 'sources']
    rows = {}
    for ln in lines:
        cells = dict(zip(cols, (c.strip() for c in ln.strip('|').split('|'))))
        m = re.fullmatch(r'`(\w+)`(?: `--partition (\w+)`)?', cells['machine'])
        rows[m.groups()] = cells
    return rows, section


def test_the_docs_table_is_what_the_generator_renders():
    """Every GPU node shape (and Jean Zay's 8-GPU V100 partitions) has a row in docs/slurm.md, and a
    full node rendered asks for exactly that row's GPUs, cores, memory, GPU request and partition,
    citing its sources."""
    rows, section = docs_sites_table()
    shapes = [(m, None) for m in S.MACHINES if m not in ('generic', 'cpu')] + [k for k in S.PARTITIONS]
    assert set(rows) == set(shapes)
    for (machine, partition), row in rows.items():
        m = S.spec(machine, partition)
        text = S.render(machine, m['gpus_per_node'], partition=partition)
        opts = dict(re.match(r'#SBATCH --([\w-]+)=?(\S*)', ln).groups() for ln in text.splitlines()
                    if ln.startswith('#SBATCH'))
        request = f"--gpus-per-node={opts['gpus-per-node']}" if 'gpus-per-node' in opts else f"--gres={opts['gres']}"
        assert row['request'] == f'`{request}`' and int(request.split(':')[-1]) == int(row['gpus'])
        assert (row['cpus'], row['mem'], row['partition']) == (opts['cpus-per-task'], opts.get('mem', '—'),
                                                               opts.get('partition', '—')), (machine, partition)
        assert row['nodes'] == m['title'] and row['sources'] == ', '.join(m['sources'])
    for key, where in machines.SOURCES.items():  # each source is listed with its address
        assert f'- `{key}`' in section and where.split()[0] in section, key


def test_jean_zay_gpu_p2_is_eight_gpus_and_three_cores():
    text = S.render('v100', 8, partition='gpu_p2')
    for line in ('--nodes=1 ', '--ntasks-per-node=8 ', '--gres=gpu:8 ', '--cpus-per-task=3 ', '--partition=gpu_p2 '):
        assert f'#SBATCH {line}' in text, line
    assert '--constraint' not in text and S.shape('v100', 16, 'gpu_p2') == (2, 8)
    assert S.main(['--machine', 'v100', '--partition', 'gpu_p2l', '--gpus', '8', '--dry-run']) == 0


def test_site_set_ups(capsys):
    jz = S.render('h100', 4).splitlines()
    order = [next(i for i, ln in enumerate(jz) if ln.startswith(w)) for w in
             ('module purge', 'module load arch/h100', 'conda deactivate', 'module load pytorch-gpu/')]
    assert order == sorted(order)  # IDRIS's order
    ac = S.render('narval', 8)
    assert 'srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 bash << \'EOF\'' in ac  # a venv on every node
    assert 'virtualenv --no-download "$SLURM_TMPDIR/env"' in ac and 'pip install --no-index -r requirements.txt' in ac
    assert "    --stage-dir '$SLURM_TMPDIR' \\" in ac and 'module load StdEnv/2023 python/3.11' in ac
    assert "--stage-dir '" not in S.render('trillium', 4)  # its $SLURM_TMPDIR is memory
    jsc = S.render('booster', 8)
    assert 'export DLOJZ_MASTER_SUFFIX=${DLOJZ_MASTER_SUFFIX-i}' in jsc and '#SBATCH --mem=0 ' in jsc
    assert "--stage-dir '" not in jsc and 'module load Stages/2025' in jsc
    mps = S.render('narval', 1, ranks_per_gpu=4)
    assert 'nvidia-cuda-mps-control -d' in mps and '#SBATCH --ntasks-per-node=4 ' in mps and \
        '#SBATCH --cpus-per-task=3 ' in mps and '#SBATCH --gpus-per-node=a100:1 ' in mps
    assert S.main(['--machine', 'trillium', '--gpus', '2', '--dry-run']) == 2
    assert 'the site allows 1 or a multiple of 4 GPUs per job' in capsys.readouterr().err


def test_every_gpu_script_but_jean_zays_asks_for_memory():
    """A script that asks for no memory gets the site's default, 256 MB per core at Alliance Canada,
    and is killed for memory before its first step. Jean Zay gives memory with the cores (no --mem
    there)."""
    for machine, gpus, ranks in S.SHIPPED:
        if machine != 'cpu' and S.MACHINES[machine]['site'] != 'jz':
            text = S.render(machine, gpus, ranks_per_gpu=ranks)
            assert re.search(r'^#SBATCH --mem(-per-gpu)?=\S+', text, re.M), (machine, gpus)

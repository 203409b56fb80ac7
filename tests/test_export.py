"""dlojz_export.py: a trained checkpoint exported with torch.export, loaded back, gives the logits
of torchvision's network holding the checkpoint's weights (the reference, built here); with
--aoti, a C++ program built against the wheel's LibTorch by docs/seeds.md's own command loads the
package and gives the same logits (slow: it compiles). A file that is not a checkpoint, and --ema
without EMA weights, are refused in one sentence.

Run: python -m pytest -q tests/test_export.py (the C++ one: -m slow)"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, run_main
from dlojzlib.errors import UsageError
from dlojzlib.tools.export import network

AOTI = tuple(int(v) for v in torch.__version__.split('.')[:2]) >= (2, 6)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp('trained')
    run_main(out, cache_dir, '--test-nsteps', '2', '--chkpt')
    path, = glob.glob(str(out / 'checkpoint-*.pt'))
    return path


def reference(path, images):
    """torchvision's ResNet-18 with the checkpoint's weights: the logits to match."""
    ckpt = torch.load(path, map_location='cpu', weights_only=False)
    model = torchvision.models.resnet18(num_classes=ckpt['num_classes'])
    model.load_state_dict(ckpt['model'])
    with torch.no_grad():
        return model.eval()(images)


def export(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_export.py'), *map(str, argv)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_an_exported_program_gives_the_checkpoints_logits(checkpoint, tmp_path):
    out = tmp_path / 'rn18.pt2'
    p = export(checkpoint, '--out', out)
    assert p.returncode == 0, p.stderr
    assert 'ExportedProgram' in p.stdout and '32 px' in p.stdout  # the run's --val-image-size
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # any batch size
    with torch.no_grad():
        got = torch.export.load(str(out)).module()(images)
    torch.testing.assert_close(got, reference(checkpoint, images), rtol=1e-5, atol=1e-5)


def test_what_is_not_a_checkpoint_is_refused_in_one_sentence(checkpoint, tmp_path):
    bad = tmp_path / 'x.pt'
    torch.save({'weights': 1}, bad)
    p = export(bad, '--out', tmp_path / 'y.pt2')
    assert p.returncode == 2 and p.stderr.count('\n') == 1 and 'not a dlojz checkpoint' in p.stderr
    p = export(checkpoint, '--out', tmp_path / 'y.pt2', '--ema')
    assert p.returncode == 2 and p.stderr.count('\n') == 1 and 'holds no EMA weights' in p.stderr
    assert not (tmp_path / 'y.pt2').exists()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
FIELDS = st.fixed_dictionaries({}, optional={
    'model': JSON | st.just({'fc.weight': torch.zeros(2, 512)}),
    'arch': JSON | st.sampled_from(['resnet18', 'resnet50', 'nonet', '']),
    'num_classes': JSON | st.integers(-2, 10**12), 'args': JSON | st.fixed_dictionaries(
        {}, optional={'val_image_size': JSON | st.integers(-2, 10**9)}),
    'ema': JSON})


@settings(max_examples=60, deadline=1000)
@given(ckpt=JSON | FIELDS, ema=st.booleans())
def test_any_checkpoint_content_gives_a_network_or_one_sentence(ckpt, ema):
    """What the reader of a checkpoint gets (an edited file, another program's): a network, or a
    UsageError naming the file, within a second."""
    try:
        model, size = network(ckpt, 'c.pt', ema)
    except UsageError as e:
        assert 'c.pt' in str(e) or '--ema' in str(e)
    else:
        assert isinstance(model, torch.nn.Module) and 0 < size <= 4096


@pytest.mark.skipif(AOTI, reason='this torch has AOTInductor packages (the floor, 2.4, has not)')
def test_aoti_below_torch_2_6_is_refused_in_one_sentence(checkpoint, tmp_path):
    p = export(checkpoint, '--out', tmp_path / 'm.pt2', '--aoti')
    assert p.returncode == 2 and p.stderr.count('\n') == 1, p.stderr
    assert '--aoti needs torch 2.6 or later' in p.stderr and not (tmp_path / 'm.pt2').exists()


LOADER = r'''
#include <iostream>
#include <torch/torch.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
int main(int argc, char** argv) {
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  auto x = torch::arange(3 * 3 * 32 * 32, torch::kFloat32).reshape({3, 3, 32, 32}).div(9216.0);
  auto y = loader.run({x})[0].contiguous();
  std::cout.precision(9);
  for (int64_t i = 0; i < y.numel(); ++i) std::cout << y.view(-1)[i].item<float>() << "\n";
}
'''


def documented_build():
    """docs/seeds.md's build of a LibTorch program: the lines of its bash block that set TORCH and
    call g++ (continuation lines joined), as a user copies them."""
    with open(os.path.join(ROOT, 'docs', 'seeds.md')) as f:
        text = f.read()
    block, = [b for b in re.findall(r'```bash\n(.*?)```', text, re.S) if 'g++' in b]
    lines = block.replace('\\\n', ' ').splitlines()
    return [line for line in lines if line.startswith(('TORCH=', 'g++ '))]


def test_the_documented_build_sets_torch_and_calls_gxx():
    torch_line, gxx = documented_build()
    assert torch_line.startswith('TORCH=$(python -c') and ' load.cpp -o load ' in gxx
    assert '-Wl,--no-as-needed -ltorch ' in gxx and '-Wl,-rpath,"$TORCH/lib"' in gxx


@pytest.mark.slow  # 70 s: the export compiles the package, g++ the program
@pytest.mark.skipif(not AOTI or shutil.which('g++') is None,
                    reason='AOTInductor packages need torch 2.6 and a C++ compiler')
def test_a_cpp_program_loads_the_package_and_gives_the_same_logits(checkpoint, tmp_path):
    """Built with docs/seeds.md's command as written (its `python` this interpreter), run with no
    LD_LIBRARY_PATH: the rpath and the kept libtorch.so are all it needs."""
    out = tmp_path / 'rn18-aoti.pt2'
    p = export(checkpoint, '--out', out, '--aoti')
    assert p.returncode == 0, p.stderr
    (tmp_path / 'load.cpp').write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != 'LD_LIBRARY_PATH'}
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
    build = subprocess.run(['bash', '-ec', '\n'.join(documented_build())], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600, env=env)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(tmp_path / 'load'), str(out)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.tensor([float(v) for v in run.stdout.split()]).view(3, -1)
    images = torch.arange(3 * 3 * 32 * 32, dtype=torch.float32).view(3, 3, 32, 32) / 9216.0
    torch.testing.assert_close(got, reference(checkpoint, images), rtol=1e-4, atol=1e-4)

"""Export a trained dlojz checkpoint for C++ (the Alliance guide's LibTorch section) with
torch.export: the network in evaluation mode, its batch dimension dynamic (1 to 1024 images), its
image size fixed.

    python dlojz_export.py runs/x/best.pt --out resnet50.pt2          # an ExportedProgram
    python dlojz_export.py runs/x/best.pt --out resnet50.pt2 --aoti   # an AOTInductor package

- Without --aoti: an ExportedProgram (torch.export.save). Python loads it with torch.export.load;
  it is the input of every later compilation.
- With --aoti (torch 2.6 or later, and a C++ compiler): AOTInductor's package, which C++ loads
  without Python through LibTorch's torch::inductor::AOTIModelPackageLoader (docs/seeds.md).
TorchScript, which the guide used (torch.jit.trace), is deprecated in torch's documentation in
favour of torch.export.

The file written is loaded back and its logits compared with the checkpoint's network on random
images. The largest difference is printed; above TOLERANCE the export is refused and the file
removed."""
import argparse
import math
import os
import sys

import torch

import custom_models
from dlojzlib import compat
from dlojzlib.errors import UsageError, first_line
from dlojzlib.flags import POSITIVE_INT
from dlojzlib.record.checkpoint import load_checkpoint

TOLERANCE = 1e-3  # largest difference between the logits, relative to their largest magnitude
MAX_BATCH = 1024
MAX_CLASSES, MAX_SIZE = 100_000, 4096  # beyond: not a checkpoint dlojz wrote (ImageNet-21k: 21841)


def network(ckpt, path, ema=False):
    """The checkpoint's network in evaluation mode, on the CPU. -> (model, image size)."""
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get('model'), dict) or \
            not isinstance(ckpt.get('arch'), str):
        raise UsageError(f'{path} is not a dlojz checkpoint (no model or arch in it); export a '
                         f'checkpoint-*.pt or best.pt written by dlojz.py --chkpt.')
    args = ckpt.get('args') if isinstance(ckpt.get('args'), dict) else {}
    size = args.get('val_image_size') or args.get('image_size') or 224
    classes = ckpt.get('num_classes')
    if not (type(classes) is int and 0 < classes <= MAX_CLASSES and type(size) is int and
            0 < size <= MAX_SIZE):
        raise UsageError(f'{path} does not hold a network dlojz can build (num_classes '
                         f'{classes!r}, image size {size!r}); export a checkpoint written by '
                         f'dlojz.py --chkpt.')
    state = ckpt['model']
    if ema:
        if not isinstance(ckpt.get('ema'), dict) or not isinstance(ckpt['ema'].get('module'), dict):
            raise UsageError('--ema: this checkpoint holds no EMA weights (its run had no '
                             '--ema-decay); export without --ema.')
        state = ckpt['ema']['module']
    try:  # the fields of a file that may have been edited or written by another program
        model = custom_models.build_model(ckpt['arch'], classes,
                                          args.get('sd_prob', 0.5), args.get('n_heads', 3), size)
        model.load_state_dict(state)
    except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as e:
        raise UsageError(f'{path} does not hold a network dlojz can build ({type(e).__name__}: '
                         f'{first_line(e)[:200]}); export a checkpoint written by dlojz.py '
                         f'--chkpt.') from None
    return model.eval(), size


def export(path, out, aoti=False, image_size=None, ema=False, say=print):
    """Write `out` and check it against the checkpoint. -> the largest difference of the logits,
    relative to their largest magnitude."""
    if aoti and not compat.aoti_available():  # before any tracing
        raise UsageError(f'--aoti needs torch 2.6 or later (AOTInductor\'s packages); this '
                         f'is torch {torch.__version__}: export without --aoti (an '
                         f'ExportedProgram).')
    model, size = network(load_checkpoint(path, given='CHECKPOINT'), path, ema)
    size = image_size or size
    example = torch.randn(2, 3, size, size)
    batch = torch.export.Dim('batch', min=1, max=MAX_BATCH)
    try:
        with torch.no_grad():
            program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    except Exception as e:  # torch.export's many errors: an image size the network refuses, ...
        raise UsageError(f'torch.export could not trace --arch {model.__class__.__name__} at '
                         f'{size} px ({type(e).__name__}: {first_line(e)[:200]}); try the run\'s '
                         f'own image size (leave --image-size out).') from None
    if aoti:
        compat.aoti_compile_and_package(program, out)
        loaded = compat.aoti_load_package(out)
    else:
        torch.export.save(program, out)
        loaded = torch.export.load(out).module()
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(images), loaded(images)
    diff = ((want - got).abs().max() / want.abs().max().clamp(min=1e-12)).item()
    if not math.isfinite(diff) or diff > TOLERANCE:
        os.remove(out)
        raise UsageError(f'the exported network\'s logits differ from the checkpoint\'s by '
                         f'{diff:.3g} of their magnitude (more than {TOLERANCE:g}); nothing was '
                         f'written. Report it with the checkpoint\'s --arch.')
    kind = 'AOTInductor package (C++: torch::inductor::AOTIModelPackageLoader)' if aoti else \
        'ExportedProgram (torch.export.load)'
    say(f'Exported {path} ({size} px, batch 1 to {MAX_BATCH}) to {out}: {kind}; loaded back, its '
        f'logits differ from the checkpoint\'s by {diff:.2g} of their magnitude.')
    return diff


def parser():
    p = argparse.ArgumentParser(prog='dlojz_export.py', description=__doc__.split('\n\n')[0],
                                epilog=__doc__[__doc__.index('\n\n') + 2:],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('checkpoint', help='a checkpoint-*.pt, best.pt or checkpoint-*.dcp of dlojz.py')
    p.add_argument('--out', required=True, help='the file to write (.pt2)')
    p.add_argument('--aoti', action='store_true', help='an AOTInductor package for C++ (LibTorch)')
    p.add_argument('--image-size', type=POSITIVE_INT,
                   help='pixels (default: the run\'s --val-image-size)')
    p.add_argument('--ema', action='store_true', help='the EMA weights (runs with --ema-decay)')
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    try:
        if os.path.isdir(a.out) or not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
            raise UsageError(f'--out {a.out} is a folder or lies in a folder that does not '
                             f'exist; give a file name (.pt2) in an existing folder.')
        if not os.path.exists(a.checkpoint):
            raise UsageError(f'{a.checkpoint} does not exist; give a checkpoint-*.pt, best.pt or '
                             f'checkpoint-*.dcp written by dlojz.py --chkpt.')
        export(a.checkpoint, a.out, a.aoti, a.image_size, a.ema)
    except UsageError as e:
        print(f'dlojz_export: error: {e}', file=sys.stderr)
        return 2
    return 0

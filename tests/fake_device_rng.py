"""dlojz with a fake per-rank device generator, for test_ddp's RNG test (run by torchrun or python).

The fake state of rank r after n training steps is [r, n]; restoring a state sets n and is written to
$FAKE_RNG_LOG.rank<r> so that the test sees which state each rank got back."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dlojz  # noqa: E402
from dlojzlib.record import state  # noqa: E402

RANK = int(os.environ.get('RANK', '0'))
draws = [0]
real_step = dlojz.train_step


def train_step(run, images, labels):
    draws[0] += 1
    return real_step(run, images, labels)


def restore(state, device):
    draws[0] = int(state[1])
    with open(f"{os.environ['FAKE_RNG_LOG']}.rank{RANK}", 'w') as f:
        json.dump(state.tolist(), f)


dlojz.train_step = train_step
state.device_rng_state = lambda device: torch.tensor([RANK, draws[0]])
state.set_device_rng_state = restore

if __name__ == '__main__':
    sys.exit(dlojz.cli())

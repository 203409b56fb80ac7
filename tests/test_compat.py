"""dlojzlib/compat.py: each private name of torch, DALI and the standard library that dlojz reaches
is there in this environment (CI runs this file at the newest torch, at requirements.txt's floors
and with DALI), and no other module of dlojz reaches one.

A failure names the private attribute an upgrade removed or renamed: compat.py's function for it is
the one place to change.

python -m pytest -q tests/test_compat.py"""
import argparse
import glob
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from conftest import ROOT
from dlojzlib import compat
from dlojzlib.data import dali


def test_torch_has_the_private_calls_dlojz_makes():
    missing = [name for owner, name in [(torch.cuda, '_sleep'), (torch, '_foreach_lerp_'),
                                        (torch, '_foreach_copy_'), (torch, '_standard_gamma'),
                                        (torch.UntypedStorage, '_new_shared'),
                                        (torch, '_nested_view_from_buffer'),
                                        (torch.Tensor, '_use_count')]
               if not hasattr(owner, name)]
    assert missing == []


def test_torch_has_aotinductors_package_calls_from_2_6():
    import torch._inductor
    calls = ('aoti_compile_and_package', 'aoti_load_package')
    if tuple(int(v) for v in torch.__version__.split('.')[:2]) < (2, 6):
        pytest.skip('AOTInductor packages come with torch 2.6 (dlojz_export.py refuses --aoti)')
    assert [name for name in calls if not hasattr(torch._inductor, name)] == []


def test_the_wrappers_do_what_their_public_counterparts_do():
    """Each against a public computation of the same result."""
    a, b = [torch.zeros(3), torch.ones(2)], [torch.full((3,), 4.0), torch.full((2,), 3.0)]
    compat.foreach_lerp_(a, b, 0.25)
    assert torch.equal(a[0], torch.full((3,), 1.0)) and torch.equal(a[1], torch.full((2,), 1.5))
    ints = [torch.zeros(2, dtype=torch.long)]
    compat.foreach_copy_(ints, [torch.tensor([5, 6])])
    assert ints[0].tolist() == [5, 6]
    draws = compat.standard_gamma(torch.full((4000,), 2.0), torch.Generator().manual_seed(0))
    assert abs(draws.mean().item() - 2.0) < 0.1  # Gamma(k, 1) has mean k
    again = compat.standard_gamma(torch.full((4000,), 2.0), torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)  # drawn from the generator given
    storage = compat.shared_storage(64)
    assert storage.nbytes() == 64 and storage.is_shared()
    # the nested view: the matrices torch.nested.nested_tensor copies from a list, without a copy
    flat = torch.arange(2 * 3 + 4 * 1, dtype=torch.float32)
    view = compat.nested_view(flat, [(2, 3), (4, 1)])
    want = torch.nested.nested_tensor([flat[:6].view(2, 3), flat[6:].view(4, 1)])
    assert all(torch.equal(a, b) for a, b in zip(view.unbind(), want.unbind()))
    assert view.values().data_ptr() == flat.data_ptr()  # a view of the buffer
    # a tensor's C++ owners: its Python object; then a view of it as well (it holds its base)
    owned = torch.zeros(2)
    alone = compat.use_count(owned)
    held = owned.view(-1)
    assert (alone, compat.use_count(owned)) == (1, 2)


def test_fused_optimizers_are_told_apart():
    p = torch.nn.Parameter(torch.zeros(2))
    assert compat.fuses_amp_scaling(torch.optim.AdamW([p], fused=True))
    assert not compat.fuses_amp_scaling(torch.optim.AdamW([p], foreach=False))


def test_a_dataloader_keeps_its_persistent_iterator_where_compat_reads_it():
    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True)
    assert compat.loader_iterator(loader) is None
    it = iter(loader)
    assert compat.loader_iterator(loader) is it and compat.is_multiprocessing_iterator(it)
    # what abandon_iterator stops and marks
    assert hasattr(it, '_workers') and hasattr(it, '_shutdown')
    assert [b[0].tolist() for b in it] == [[0.0, 1.0], [2.0, 3.0]]
    compat.abandon_iterator(it)
    assert it._shutdown and all(not w.is_alive() for w in it._workers)
    # nothing left in torch's SIGCHLD watch list under its id, which a later iterator may reuse
    with pytest.raises(ValueError, match='Cannot find worker information'):
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))


def test_a_dataloader_iterator_stops_its_workers_when_asked():
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    assert hasattr(it, '_shutdown_workers'), '_MultiProcessingDataLoaderIter._shutdown_workers'
    compat.shutdown_workers(it)
    assert not any(w.is_alive() for w in it._workers)
    compat.shutdown_workers(it)  # the second time does nothing (the iterator's __del__ calls it)


def test_ddp_has_the_buffer_broadcast_comm_times():
    """On a one-rank gloo group: DDP's _sync_buffers is there and can be replaced. An in-memory
    store: no port, and no MASTER_* variable left for the tests after this one."""
    import torch.distributed as tdist
    tdist.init_process_group('gloo', store=tdist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.BatchNorm1d(2))
        assert compat.ddp_buffer_sync(ddp) is not None, 'DistributedDataParallel._sync_buffers'
        calls = []
        compat.replace_ddp_buffer_sync(ddp, lambda: calls.append(1))
        ddp(torch.randn(4, 2))
        assert calls == [1]
    finally:
        tdist.destroy_process_group()


def test_a_dcp_folder_is_read_whole_without_a_state_dict_to_fill(tmp_path):
    import io
    import warnings

    import torch.distributed.checkpoint as dcp
    saved = {'model': {'w': torch.arange(6.0).reshape(2, 3)}, 'rest': io.BytesIO(b'dlojz')}
    with warnings.catch_warnings():  # 'no process group: saving in one process' is what we ask
        warnings.simplefilter('ignore')
        dcp.save(saved, checkpoint_id=str(tmp_path))
    read = compat.load_whole_dcp(str(tmp_path))
    assert torch.equal(read['model']['w'], saved['model']['w'])
    assert read['rest'].getvalue() == b'dlojz'


def test_the_standard_library_keeps_what_compat_reads():
    with ProcessPoolExecutor(1) as pool:
        assert pool.submit(abs, -1).result() == 1
        assert len(compat.pool_processes(pool)) == 1
    p = argparse.ArgumentParser()
    p.add_argument('--x')
    assert [a.dest for a in compat.parser_actions(p)] == ['help', 'x']


@pytest.mark.skipif(dali.dali() is None,
                    reason='NVIDIA DALI is not installed (.ci/run installs it in a stage)')
def test_a_dali_pipeline_keeps_its_native_half_where_compat_reads_it():
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def constant():
        return fn.random.uniform(range=(0, 1))
    pipe = constant()
    pipe.build()
    assert compat.dali_native_pipeline(pipe) is not None, 'nvidia.dali.Pipeline._pipe'
    inner = compat.dali_native_pipeline(pipe)
    compat.detach_dali_native_pipeline(pipe)
    assert compat.dali_native_pipeline(pipe) is None
    pipe._pipe = inner  # shut down as usual


PRIVATE = re.compile(r'(?<!self)\.(_sleep|_foreach_lerp_|_foreach_copy_|_standard_gamma|'
                     r'_new_shared|_iterator|_MultiProcessingDataLoaderIter|_sync_buffers|'
                     r'_processes|_actions|_pipe|_shutdown_workers|_nested_view_from_buffer)\b|'
                     r"'_(workers|shutdown|sync_buffers|step_supports_amp_scaling|pipe)'")


def test_no_other_module_reaches_a_private_name():
    files = glob.glob(os.path.join(ROOT, '*.py'))
    files += glob.glob(os.path.join(ROOT, 'dlojzlib', '**', '*.py'), recursive=True)
    hits = []
    for path in files:
        if path.endswith(os.path.join('dlojzlib', 'compat.py')):
            continue
        for n, line in enumerate(open(path), 1):
            code = line.split('#')[0]
            if PRIVATE.search(code):
                hits.append(f'{os.path.relpath(path, ROOT)}:{n}: {line.strip()}')
    assert hits == []

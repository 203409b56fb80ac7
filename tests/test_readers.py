"""dlojzlib.readers, the one door of every file dlojz reads back (issue 49): any bytes give a value
of the declared shape or Unreadable, within a second; a special file is refused without blocking;
a name read from a file never leads out of its folder."""
import argparse
import json
import os
import posixpath
import threading

import pytest
from hypothesis import given, settings, strategies as st

from dlojzlib import readers
from dlojzlib.readers import Dict, Int, List, Map, Maybe, Num, Rel, Str, Unreadable
from strategies import json_values

SHAPE = Dict({'version': Int(1, 1), 'root': Str(),
              'splits': Map(Map(Dict({'mtime_ns': Maybe(Int(0)), 'files': List(Rel())})))},
             optional=['root'])

JSON = json_values(keys=8, size=4, leaves=20)


def within(path, root):
    real = posixpath.normpath(posixpath.join(root, path))
    return real.startswith(root.rstrip('/') + '/')


@settings(deadline=1000, max_examples=300)
@given(st.binary(max_size=300))
def test_any_bytes_give_a_value_or_one_reason(tmp_path_factory, data):
    path = tmp_path_factory.mktemp('b') / 'f.json'
    path.write_bytes(data)
    try:
        value = readers.read_json(str(path), SHAPE)
    except Unreadable as e:
        assert str(e).startswith(str(path)) and '\n' not in str(e)
    else:
        assert value['version'] == 1


@settings(deadline=1000, max_examples=300)
@given(JSON | st.fixed_dictionaries({'version': st.just(1), 'splits': JSON}))
def test_any_json_gives_its_shape_or_says_where_it_is_wrong(value):
    try:
        out = readers.parse_json('f.json', json.dumps(value), SHAPE)
    except Unreadable as e:
        assert ' at ' in e.why or 'is not JSON' in e.why, e.why
        return
    for split in out['splits'].values():
        for entry in split.values():
            assert all(within(f, '/data/train/cat') for f in entry['files'])


@settings(deadline=1000, max_examples=500)
@given(st.text(max_size=40) | st.lists(st.sampled_from(['..', '.', '', 'a', '/', 'b\0']),
                                        max_size=6).map('/'.join))
def test_no_name_read_from_a_file_leads_out_of_its_folder(name):
    if Rel().accepts(name):
        assert within(name, '/data/train/cat'), name


@pytest.mark.parametrize('name', ['../../val/dog/dog000.jpg', '/etc/passwd', 'a/../../b', '', '.',
                                  'a//b', 'a/./b', 'x\0y'])
def test_these_names_are_refused(name):
    assert not Rel().accepts(name)


def test_a_sub_folder_is_a_name_inside():
    assert Rel().accepts('sub/deeper/x.jpg') and Rel().accepts('a\\b.jpg')  # POSIX allows it


@settings(deadline=1000, max_examples=300)
@given(st.lists(st.text(max_size=12) | st.sampled_from(['..', '.', '', 'a/..', 'a/b', 'a//b']),
                max_size=6))
def test_a_list_of_names_checked_at_once_is_checked_as_one_by_one(names):
    assert Rel().all_accept(names) == all(Rel().accepts(n) for n in names)


@pytest.mark.parametrize('kind', ['fifo', 'folder', 'device'])
def test_a_special_file_is_refused_without_blocking(tmp_path, kind):
    path = {'fifo': tmp_path / 'f.json', 'folder': tmp_path, 'device': '/dev/zero'}[kind]
    if kind == 'fifo':
        os.mkfifo(path)
    out = []
    t = threading.Thread(target=lambda: out.append(pytest.raises(Unreadable, readers.read_json,
                                                                 str(path))), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader before failing
        with open(path, 'w'):
            pass
        pytest.fail(f'reading a {kind} blocked')
    assert 'not a file' in str(out[0].value)


def test_a_file_over_its_limit_is_refused(tmp_path):
    (tmp_path / 'big.json').write_bytes(b' ' * 2000)
    with pytest.raises(Unreadable, match='larger than'):
        readers.read_json(str(tmp_path / 'big.json'), limit=1000)


def test_deep_nesting_is_unreadable_not_a_recursion_error(tmp_path):
    (tmp_path / 'deep.json').write_text('[' * 100000 + ']' * 100000)
    with pytest.raises(Unreadable, match='nests deeper'):
        readers.read_json(str(tmp_path / 'deep.json'))


def test_a_missing_file_is_the_callers_to_name(tmp_path):
    with pytest.raises(FileNotFoundError):
        readers.read_json(str(tmp_path / 'none.json'))


@pytest.mark.parametrize('value, shape, ok', [
    (True, Num(), False), (float('nan'), Num(), False), (3, Int(0, 2), False), (2.5, Int(), False),
    (2, Num(0, 2), True), (10 ** 400, Num(), True), (10 ** 400, Num(0, 1e9), False),
    (None, Maybe(Int()), True), ('x', Maybe(Int()), False),
    ({'a': 1}, Dict({'a': Int(), 'b': Int()}), False), ({'a': 1}, Dict({'a': Int()}), True),
    ([1, 'x'], List(Int()), False), ({'k': 'v'}, Map(Str()), True), ({'k': 1}, Map(Str()), False)])
def test_each_shape_accepts_only_its_values(value, shape, ok):
    try:
        shape.check(value, 'x')
    except readers.Wrong:
        assert not ok
    else:
        assert ok


def test_a_wrong_value_is_named_by_where_it_is():
    with pytest.raises(Unreadable) as e:
        readers.parse_json('i.json', '{"version": 1, "splits": {"train": {"cat": {"mtime_ns": 1, '
                                     '"files": ["a.jpg", 7]}}}}', SHAPE)
    assert e.value.why == ('has the number 7 at splits.train.cat.files[1] where a file name '
                           'inside its folder is expected'), e.value.why


def test_jsonl_keeps_the_good_lines_and_counts_the_rest(tmp_path):
    (tmp_path / 'm.jsonl').write_bytes(b'{"step": 1}\n[1]\n{"step": 2}\n{"st')
    records, bad = readers.read_jsonl(str(tmp_path / 'm.jsonl'), Dict({'step': Int(0)}))
    assert records == [{'step': 1}, {'step': 2}] and bad == 2


def test_a_fifo_left_at_the_writers_temporary_name_does_not_block_it(tmp_path):
    """files.write_atomic writes <path>.tmp then renames it: a FIFO left at that name blocked its
    open for writing until a reader came."""
    from dlojzlib import files
    os.mkfifo(tmp_path / 'summary.json.tmp')
    t = threading.Thread(target=files.write_atomic, args=(str(tmp_path / 'summary.json'), '{}'),
                         daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        with open(tmp_path / 'summary.json.tmp', 'rb'):  # unblock the writer before failing
            pass
        pytest.fail('the write blocked on a FIFO')
    assert (tmp_path / 'summary.json').read_text() == '{}'


def test_a_small_file_asks_for_its_size_not_the_limit(tmp_path):
    """BufferedReader.read(n) allocates n bytes first: reading metrics.jsonl under its 16 GiB limit
    asked for 16 GiB on every resume, which fails under a strict overcommit or ulimit -v."""
    import subprocess
    import sys
    (tmp_path / 'small.json').write_text('{"a": 1}')
    code = ('import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); '
            'from dlojzlib import readers; '
            f'print(readers.read_json({str(tmp_path / "small.json")!r}, limit=16 << 30))')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip() == "{'a': 1}", r.stderr[-1000:]


# ------------------------------------------------------------------------------------------------
# The shapes every file's declaration shares (Row, Name, Num(finite=False), fields, require)

SHORT_KEYS = json_values(keys=5, size=4, leaves=20)


@settings(deadline=1000, max_examples=200)
@given(SHORT_KEYS)
def test_the_shared_shapes_give_a_value_or_wrong(value):
    for shape in (readers.Row(Str(), Int(0)), readers.Name(), Num(finite=False),
                  readers.fields(a=Int(), b=Maybe(Str())),
                  readers.require(readers.fields(a=readers.fields(b=Int())), 'a.b')):
        try:
            shape.check(value, '')
        except readers.Wrong as e:
            assert str(e).startswith('has ')


def test_row_is_a_list_of_fixed_length_one_shape_per_place():
    row = readers.Row(Str(), Int(0))
    assert row.check(['a', 1], '') == ['a', 1]
    for bad in (['a'], ['a', 1, 2], [1, 'a'], {'a': 1}):
        with pytest.raises(readers.Wrong):
            row.check(bad, '')


def test_name_is_one_component_of_a_path():
    name = readers.Name()
    for good in ('a', '...', 'a b', 'x' * 255, 'é'):
        assert name.accepts(good), good
    for bad in ('', '.', '..', 'a/b', '/a', 'a\0', 'x' * 256, 3):
        assert not name.accepts(bad), bad


def test_num_not_finite_keeps_nan_and_infinities():
    real = Num(finite=False)
    assert all(real.accepts(v) for v in (float('nan'), float('inf'), -1.5, 2 ** 62))
    assert not any(real.accepts(v) for v in (2 ** 63, True, '1'))
    assert not Num().accepts(float('nan'))


def test_fields_makes_every_field_optional_and_require_names_what_a_reader_needs():
    shape = readers.fields(a=Maybe(readers.fields(b=Maybe(Int()), c=Int())), d=Int())
    assert shape.check({}, '') == {} and shape.check({'a': None}, '') == {'a': None}
    needs = readers.require(shape, 'a.b', 'd')
    assert needs.check({'d': 1}, '') == {'d': 1}  # no 'a': its b is not asked for
    assert needs.check({'d': 1, 'a': None}, '') == {'d': 1, 'a': None}
    for bad in ({}, {'d': 1, 'a': {}}, {'d': 1, 'a': {'b': None}}):
        with pytest.raises(readers.Wrong):
            needs.check(bad, '')
    assert shape.check({'a': {}}, '') == {'a': {}}  # the declaration itself is unchanged
    listed = readers.require(readers.fields(x=List(readers.fields(y=Int()))), 'x', 'x.y')
    with pytest.raises(readers.Wrong):
        listed.check({'x': [{}]}, '')
    with pytest.raises(KeyError):
        readers.require(shape, 'a.z')


def test_present_asks_for_the_field_and_lets_it_be_null():
    """tune.json's failed trials have images_per_s null: require() refused them, present() does
    not; a row without the field at all is refused by both (the tuner looks it up by name)."""
    shape = readers.fields(rate=Maybe(Num(0)), name=Str())
    for check, null_ok in ((readers.require(shape, 'rate'), False),
                           (readers.present(shape, 'rate'), True)):
        with pytest.raises(readers.Wrong):
            check.check({'name': 'x'}, '')
        try:
            check.check({'rate': None}, '')
        except readers.Wrong:
            assert not null_ok
        else:
            assert null_ok


def test_what_dlojz_writes_reads_back_under_every_shape_declared_for_it(tmp_path, cache_dir):
    """The readers must take what the writers write: a claim's job_id '' outside Slurm was refused
    by its shape, and the long tier found it. A real run's summary.json, config.json and
    metrics.jsonl against each shape that reads them (formats', the report's, the forecast's, the
    tuner's trial summary), and its checkpoint through the resume's check."""
    from conftest import run_main
    from dlojzlib import formats
    from dlojzlib.measure import forecast_inputs
    from dlojzlib.modes import tune
    from dlojzlib.record import state
    from dlojzlib.record.checkpoint import load_checkpoint
    from dlojzlib.tools.report import shapes
    out = tmp_path / 'run'
    run_main(out, cache_dir, '--test-nsteps', '4', '--log-interval', '1', '--chkpt')
    for shape in (formats.SUMMARY, shapes.SUMMARY, forecast_inputs.SUMMARY, tune.TRIAL_SUMMARY):
        readers.read_json(str(out / 'summary.json'), shape)
    readers.read_json(str(out / 'config.json'), formats.CONFIG)
    for shape in (formats.METRIC, shapes.RECORD):
        records, bad = readers.read_jsonl(str(out / 'metrics.jsonl'), shape)
        assert records and bad == 0
    ckpt, = out.glob('checkpoint-*.pt')
    state.check_form(argparse.Namespace(evaluate=False), load_checkpoint(str(ckpt)), str(ckpt))

"""Every file dlojz reads back goes through here: the kept dataset index, a run's summary.json,
config.json and metrics.jsonl, tune.json, a shards folder's index, the staging journal, the
forecast's inputs, a checkpoint's metadata. Each reader declares its file's shape once (a `Shape`
below) and gets back a value of that shape or `Unreadable`, whose text says what is wrong in one
phrase; the caller answers it as its docs promise (a new listing, a note, or one sentence naming
the file and the fix).

Three things no reader may do, whatever is at the path:
- block: a FIFO opens at once (O_NONBLOCK needs no writer) and is refused, as is a folder or a
  device; what is checked is the file that was opened (fstat), not a second look at its name;
- read without end: a size limit per file, and nesting deeper than Python's recursion limit is an
  unreadable file, not a RecursionError;
- follow a name out of its folder: a file name read from a file is a relative path of plain
  components (`Rel`), never absolute, never `..`.
Light: no torch at import."""
import json
import math
import os
import re
import stat

MiB = 2 ** 20
LIMIT = 256 * MiB  # bytes of one JSON file: the largest dlojz writes (ImageNet's index) is ~40 MiB


class Unreadable(ValueError):
    """A file that is there but cannot be used. str(e): '<path> <why>'; e.why: the phrase alone."""

    def __init__(self, path, why):
        super().__init__(f'{path} {why}')
        self.path, self.why = path, why


class Wrong(ValueError):
    """A value of the wrong shape: where in the file (a dotted path), and what was found."""

    def __init__(self, where, found, expected):
        super().__init__(f'has {found} at {where or "its top"} where {expected} is expected')


def _kind(mode):
    for test, name in ((stat.S_ISDIR, 'a folder'), (stat.S_ISFIFO, 'a FIFO'),
                       (stat.S_ISSOCK, 'a socket'), (stat.S_ISCHR, 'a character device'),
                       (stat.S_ISBLK, 'a block device')):
        if test(mode):
            return name
    return 'not a regular file'


def open_file(path, mode='rb'):
    """Open `path` for reading without blocking, refusing anything but a regular file (Unreadable).
    A missing or forbidden file raises OSError as open() does: what it means is the caller's."""
    st = os.stat(path)  # refuses a device before opening it (an open may act on the device)
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable(path, f'is {_kind(st.st_mode)}, not a file')
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # what was opened: the name may have been replaced since the stat
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(path, f'is {_kind(st.st_mode)}, not a file')
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, limit=LIMIT):
    with open_file(path) as f:
        # read(n) allocates n bytes before it reads: the file's own size, not the limit (16 GiB
        # for metrics.jsonl), is what a small file asks for; +1 sees a file grown since the fstat
        size = os.fstat(f.fileno()).st_size
        data = f.read(min(size, limit) + 1)
    if len(data) > limit:
        raise Unreadable(path, f'is larger than {limit / MiB:.0f} MiB, more than dlojz writes '
                               f'there')
    return data


def parse_json(path, data, shape=None):
    """JSON text or bytes -> a value of `shape`, or Unreadable naming the path."""
    try:
        value = json.loads(data)
    except UnicodeDecodeError:
        raise Unreadable(path, 'is not UTF-8 text') from None
    except RecursionError:
        raise Unreadable(path, 'nests deeper than any file dlojz writes') from None
    except ValueError as e:  # JSONDecodeError, an integer of more than 4300 digits
        raise Unreadable(path, f'is not JSON ({str(e).split(":")[0]})') from None
    try:
        return value if shape is None else shape.check(value, '')
    except Wrong as e:
        raise Unreadable(path, str(e)) from None
    except RecursionError:
        raise Unreadable(path, 'nests deeper than any file dlojz writes') from None


def read_json(path, shape=None, limit=LIMIT):
    """The JSON file at `path` -> a value of `shape`. OSError (missing, forbidden) or Unreadable."""
    return parse_json(path, read_bytes(path, limit), shape)


def read_jsonl(path, shape=None, limit=LIMIT):
    """A JSON-lines file -> (the records of `shape`, the number of lines left out). A line cut by a
    kill, or of another shape, is left out and counted: an append-only record keeps what it has."""
    records, bad = [], 0
    for line in read_bytes(path, limit).splitlines():
        if not line.strip():
            continue
        try:
            records.append(parse_json(path, line, shape))
        except Unreadable:
            bad += 1
    return records, bad


# ------------------------------------------------------------------------------------------------
# Shapes: each checks a value and returns it (or raises Wrong with where it is in the file).

def found(value):
    """A few words for what a file holds where it should not."""
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return f'{str(value).lower()}'
    if isinstance(value, (int, float)):
        return f'the number {value!r}'[:40]
    if isinstance(value, str):
        return f'the text {value[:30]!r}'
    return {list: 'a list', dict: 'an object'}.get(type(value), type(value).__name__)


class Shape:
    expected = 'a value'

    def check(self, value, where):
        if not self.accepts(value):
            raise Wrong(where, found(value), self.expected)
        return value

    def accepts(self, value):
        return True


Any = Shape()


class Bool(Shape):
    expected = 'true or false'

    def accepts(self, value):
        return isinstance(value, bool)


class Num(Shape):
    """A finite number in [lo, hi] (bool is not one); integral=True: an integer. finite=False: a
    measured number that may have diverged, NaN and infinities kept (a NaN loss is what a failed
    run recorded), integers within 2^63 (beyond, no float holds them exactly)."""

    def __init__(self, lo=None, hi=None, integral=False, finite=True):
        if not finite and lo is None and hi is None:
            lo, hi = -(2 ** 63 - 1), 2 ** 63 - 1
        self.lo, self.hi, self.integral, self.finite = lo, hi, integral, finite
        span = '' if lo is None and hi is None else f' of at least {lo}' if hi is None else \
            f' of at most {hi}' if lo is None else f' from {lo} to {hi}'
        self.expected = f'{"an integer" if integral else "a number"}{span}' if finite else \
            'a number'

    def accepts(self, value):
        if isinstance(value, bool) or not isinstance(value, int if self.integral else (int, float)):
            return False
        if not self.finite and isinstance(value, float) and not math.isfinite(value):
            return True
        # an int is compared as it is: math.isfinite would convert it, and one of 400 digits does
        # not fit a float (OverflowError)
        return (isinstance(value, int) or math.isfinite(value)) and \
            (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)


def Int(lo=None, hi=None):
    return Num(lo, hi, integral=True)


class Str(Shape):
    def __init__(self, pattern=None, expected='a text', max_len=4096):
        self.pattern = re.compile(pattern) if pattern else None
        self.expected, self.max_len = expected, max_len

    def accepts(self, value):
        return isinstance(value, str) and len(value) <= self.max_len and \
            (self.pattern is None or self.pattern.fullmatch(value) is not None)


class Rel(Str):
    """A file name relative to its folder, which may go down into sub-folders but never up or out:
    plain components, none empty, '.' or '..', no NUL, not absolute. (A backslash is a character
    of a POSIX name like any other.)"""

    def __init__(self, max_len=4096):
        super().__init__(None, 'a file name inside its folder', max_len)

    def accepts(self, value):
        return super().accepts(value) and '\0' not in value and \
            all(part not in ('', '.', '..') for part in value.split('/'))

    def all_accept(self, values):
        """Whether every one of `values` (a list) is accepted, checked as one text: ImageNet's 1.3 M
        names take 0.15 s so, 0.74 s one by one (BENCHMARKS.md; the kept index, at every job's
        start)."""
        if not values or set(map(type, values)) != {str} or max(map(len, values)) > self.max_len:
            return not values
        joined = '\0'.join(values)
        if joined.count('\0') != len(values) - 1:  # a NUL inside a name
            return False
        parts = '\0' + joined.replace('/', '\0') + '\0'  # every component between NULs
        return not ('\0\0' in parts or '\0.\0' in parts or '\0..\0' in parts)


class Name(Str):
    """One component of a path, a file or folder name of its folder: not empty, '.' or '..', no
    '/' or NUL, at most 255 characters (NAME_MAX is 255 bytes)."""

    def __init__(self, expected='a file name of its folder', max_len=255):
        super().__init__(r'(?!\.\.?\Z)[^/\0]+', expected, max_len)


class Maybe(Shape):
    def __init__(self, shape):
        self.shape, self.expected = shape, f'{shape.expected} or null'

    def check(self, value, where):
        return None if value is None else self.shape.check(value, where)


class Either(Shape):
    def __init__(self, *shapes):
        self.shapes = shapes
        self.expected = ' or '.join(s.expected for s in shapes)

    def check(self, value, where):
        for s in self.shapes:
            try:
                return s.check(value, where)
            except Wrong:
                pass
        raise Wrong(where, found(value), self.expected)


class List(Shape):
    def __init__(self, of=Any, max_len=None, expected=None):
        self.of, self.max_len = of, max_len
        self.expected = expected or f'a list, each item {of.expected}'

    def check(self, value, where):
        if not isinstance(value, list) or (self.max_len is not None and len(value) > self.max_len):
            raise Wrong(where, found(value), self.expected)
        if isinstance(self.of, Rel) and self.of.all_accept(value):
            return value
        return [self.of.check(v, f'{where}[{i}]') for i, v in enumerate(value)]


class Row(Shape):
    """A list of fixed length with a shape per place: the rows dlojz writes as JSON lists (a
    sidecar's samples, the staging journal's files, a timeline chunk), as Dict is for objects."""

    def __init__(self, *shapes):
        self.shapes = shapes
        self.expected = f'a list of {len(shapes)}: ' + ', '.join(s.expected for s in shapes)

    def check(self, value, where):
        if not isinstance(value, list) or len(value) != len(self.shapes):
            raise Wrong(where, found(value), self.expected)
        return [s.check(v, f'{where}[{i}]') for i, (s, v) in enumerate(zip(self.shapes, value))]


ALL = 'all'  # Dict(..., optional=ALL): every field may be absent


class Dict(Shape):
    """An object with these fields (each a Shape). optional: the names that may be absent (ALL:
    every one); other fields are kept unchecked (a newer dlojz may add some)."""

    def __init__(self, fields, optional=(), expected='an object'):
        optional = fields if optional is ALL else optional
        self.fields, self.optional, self.expected = fields, set(optional), expected

    def check(self, value, where):
        if not isinstance(value, dict):
            raise Wrong(where, found(value), self.expected)
        out = dict(value)
        for name, shape in self.fields.items():
            at = f'{where}.{name}' if where else name
            if name in value:
                out[name] = shape.check(value[name], at)
            elif name not in self.optional:
                raise Wrong(at, 'nothing', shape.expected)
        return out


class Map(Shape):
    """An object of any keys (each a `key` text), every value of one shape."""

    def __init__(self, of=Any, key=None, expected=None):
        self.of, self.key = of, key or Str()
        self.expected = expected or 'an object'

    def check(self, value, where):
        if not isinstance(value, dict):
            raise Wrong(where, found(value), self.expected)
        out = {}
        for k, v in value.items():
            at = f'{where}.{k}' if where else str(k)
            self.key.check(k, at)
            out[k] = self.of.check(v, at)
        return out


def fields(**shapes):
    """An object whose fields are all optional (an older dlojz, or another mode, wrote fewer)."""
    return Dict(shapes, optional=ALL)


def require(shape, *paths):
    """A copy of `shape` where each dotted path (through objects, lists' items and nulls) must be
    there and not null, where its parent is: what one reader needs of a file whose shape is declared
    once for all (dlojzlib/formats.py). 'timing.totals.wall_s': a summary without timing, or
    whose timing has no totals, still passes; totals without wall_s does not."""
    for path in paths:
        shape = _require(shape, path.split('.'), null=False)
    return shape


def present(shape, *paths):
    """As require, but a field of the paths may be null where its shape allows it: a reader that
    looks a field up by name and handles None (a failed trial's rate)."""
    for path in paths:
        shape = _require(shape, path.split('.'), null=True)
    return shape


def _require(shape, names, null):
    if isinstance(shape, Maybe):
        return Maybe(_require(shape.shape, names, null))
    if isinstance(shape, List):
        return List(_require(shape.of, names, null), shape.max_len, shape.expected)
    if isinstance(shape, Map):  # every value of the map
        return Map(_require(shape.of, names, null), shape.key, shape.expected)
    if not isinstance(shape, Dict) or names[0] not in shape.fields:
        raise KeyError(f'{".".join(names)} is not a field of {shape.expected}')
    name, field = names[0], shape.fields[names[0]]
    if len(names) == 1:
        field = field.shape if isinstance(field, Maybe) and not null else field
        optional = shape.optional - {name}
    else:
        field, optional = _require(field, names[1:], null), shape.optional
    return Dict({**shape.fields, name: field}, optional, shape.expected)

"""What the input tests share: any JSON value (a hypothesis strategy), every place in one, and the
value with one place changed."""
import copy

from hypothesis import strategies as st

DELETE = object()  # replaced()'s `new` that removes the place instead


def json_values(text=None, keys=8, size=4, leaves=20, ints=None):
    """Any JSON document: null, booleans, integers (`ints`: all by default), floats (NaN and the
    infinities included, as json.dumps writes them) and strings of at most `text` characters (None:
    any), in lists and objects of at most `size` items whose keys have at most `keys` characters
    (or are drawn from `keys`, a strategy); at most `leaves` scalars in all."""
    keys = st.text(max_size=keys) if isinstance(keys, int) else keys
    scalars = (st.none() | st.booleans() | (ints or st.integers()) | st.floats()
               | st.text(max_size=text))
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=size)
                        | st.dictionaries(keys, kids, max_size=size), max_leaves=leaves)


def paths_of(value, at=(), items=None):
    """Every place in a JSON value, as the tuple of keys and indices to it (the value itself: ());
    items: only a list's first so many."""
    yield at
    kids = value.items() if isinstance(value, dict) else \
        enumerate(value[:items]) if isinstance(value, list) else ()
    for k, v in kids:
        yield from paths_of(v, at + (k,), items)


def replaced(value, at, new):
    """A copy of `value` with the place `at` holding `new` (DELETE: without it)."""
    if not at:
        return new
    value = copy.deepcopy(value)
    parent = value
    for k in at[:-1]:
        parent = parent[k]
    if new is DELETE:
        del parent[at[-1]]
    else:
        parent[at[-1]] = new
    return value

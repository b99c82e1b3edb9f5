"""The raw-data spec (YAML): which columns of a CSV or Parquet log become the label, the numerical
and the categorical features, and how the rows split (docs/preprocessing.md has a complete
example). `load` validates it all and raises ConfigError with one line naming the file and key.
"""
import dataclasses
import os
from typing import List, Optional, Tuple

import yaml

from preproc.layout import MAPPINGS
from utils.errors import ConfigError

TRANSFORMS = ("log", "none", "clip")
TYPES = ("string", "hex", "int")
DERIVED = ("hour", "weekday")


@dataclasses.dataclass
class Numerical:
    name: str
    column: str
    transform: str = "log"           # log: log(x + 3), x < -2 counts as -2; none; clip to [low, high]
    low: Optional[float] = None
    high: Optional[float] = None
    fill: float = 0.0                # a missing value's output


@dataclasses.dataclass
class Categorical:
    name: str
    column: str
    type: str = "string"             # string | hex | int: how a value becomes its uint64 key
    threshold: int = 0               # vocabulary: values seen fewer times in training -> id 0
    buckets: Optional[int] = None    # hashed instead: id 1 + key % buckets
    delimiter: Optional[str] = None  # multi-hot: the separator of the values in the field
    max_hotness: Optional[int] = None
    derive: Optional[str] = None     # hour | weekday of the column's unix seconds (UTC)
    history: Optional["History"] = None   # a history feature (no column of its own)


@dataclasses.dataclass
class History:
    """A user's earlier items: per event, the ids of `of` (a one-hot categorical feature) of the
    last `max_length` events of the same `user` strictly before its `time`, oldest first.
    `aligned_with` H (a side feature of H): the same events as H's history, position by position,
    holding `of`'s ids (those events' category, say; a missing value id 0); with `gaps`, their
    time before the event as ids (preproc.history.gap_ids). Both take H's user, time, max_length
    and only_positive."""
    of: str                          # the item feature (its name): its vocabulary's ids, or its raw ids
    user: str                        # the user column (values compared as text)
    time: str                        # the time column (numbers)
    max_length: int
    only_positive: bool = False      # only events with a positive label count
    aligned_with: Optional[str] = None   # the history (its name) whose events a side feature follows
    gaps: bool = False                   # the time gaps of aligned_with's events
    counting_item: Optional[str] = None  # aligned_with's item feature, once the spec is read

    @property
    def counts_of(self) -> str:
        """The item feature an event needs a value of to count (with a user)."""
        return self.counting_item or self.of


@dataclasses.dataclass
class RawSpec:
    paths: List[str]
    label: str
    numerical: List[Numerical]
    categorical: List[Categorical]
    format: str = "csv"              # csv | parquet
    delimiter: str = ","
    header: bool = True
    columns: Optional[List[str]] = None      # csv without a header: the column names in order
    positive: Optional[List[str]] = None     # label: these values are positive, others negative
    label_threshold: Optional[float] = None  # label: numbers >= this are positive
    split: str = "fraction"                  # fraction | column | files
    test: float = 0.05                       # fraction split: shares in file order
    validation: float = 0.05
    order: Optional[Tuple[str, ...]] = None  # fraction split: the mappings in file order (None: train, test, validation)
    split_column: Optional[str] = None       # column split: value < test_from train, < validation_from test,
    test_from: Optional[float] = None        # the rest validation (a missing bound: that mapping is empty)
    validation_from: Optional[float] = None
    test_files: List[str] = dataclasses.field(default_factory=list)        # files split: these files test,
    validation_files: List[str] = dataclasses.field(default_factory=list)  # these validation, the rest train

    def file_mapping(self, path: str) -> int:
        """A files split: the mapping index (0 train, 1 test, 2 validation) of an input file."""
        path = os.path.abspath(path)
        return 1 if path in map(os.path.abspath, self.test_files) else \
            2 if path in map(os.path.abspath, self.validation_files) else 0

    def columns_used(self) -> List[str]:
        used = [self.label] + [n.column for n in self.numerical] + \
            [name for c in self.categorical
             for name in ([c.history.user, c.history.time] if c.history else [c.column])]
        return list(dict.fromkeys(used + ([self.split_column] if self.split_column else [])))


class _Reader:
    """Typed access to one mapping of the spec; errors name `where` and the key."""

    def __init__(self, raw, where: str, key: str, allowed):
        self.where, self.key = where, key
        if not isinstance(raw, dict):
            self.fail("", f"must be a mapping, got {raw!r}")
        unknown = sorted(set(map(str, raw)) - set(allowed))
        if unknown:
            self.fail(unknown[0], f"unknown key (expected {', '.join(allowed)})")
        self.raw = raw

    def fail(self, name: str, message: str):
        _fail(f"{self.where}: {'.'.join(filter(None, [self.key, name]))}: {message}")

    def get(self, name, kind, default=None, required=False, check=None, expect=""):
        """The value of `name`: of `kind` (a type or tuple; bool is never a number), passing `check`."""
        if name not in self.raw or self.raw[name] is None:
            if required:
                self.fail(name, "missing")
            return default
        value = self.raw[name]
        if (not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind))
                or (check and not check(value))):
            self.fail(name, f"must be {expect or _tuple(kind)[0].__name__}, got {value!r}")
        return value

    def names(self, name, required=False):
        value = self.get(name, (list, str), required=required, expect="a name or a list of names")
        if value is None:
            return None
        value = [value] if isinstance(value, str) else value
        if not value or not all(isinstance(v, str) and v for v in value):
            self.fail(name, f"must be a name or a non-empty list of names, got {value!r}")
        return value


def _tuple(kind):
    return kind if isinstance(kind, tuple) else (kind,)


NUMBER = (int, float)


def _fail(message: str):
    raise ConfigError(message)


def load(path: str) -> RawSpec:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        _fail(f"--spec {path}: cannot read it ({e.strerror})")
    except yaml.YAMLError as e:
        _fail(f"{path}: not valid YAML ({' '.join(str(e).split())})")
    return parse(raw, path, os.path.dirname(os.path.abspath(path)))


def parse(raw, where: str = "raw spec", base_dir: str = ".") -> RawSpec:
    top = _Reader(raw, where, "", ("inputs", "label", "numerical", "categorical", "split"))
    inputs = _Reader(top.get("inputs", dict, required=True), where, "inputs",
                     ("paths", "format", "delimiter", "header", "columns"))
    spec = RawSpec([os.path.join(base_dir, p) for p in inputs.names("paths", required=True)], "", [], [])
    spec.format = inputs.get("format", str, "csv", check=lambda v: v in ("csv", "parquet"), expect="csv or parquet")
    spec.delimiter = inputs.get("delimiter", str, ",", check=lambda v: len(v) == 1 and v not in "\n\r\"",
                                expect="one character")
    spec.header = inputs.get("header", bool, True, expect="true or false")
    spec.columns = inputs.names("columns")
    if spec.format == "csv" and not spec.header and not spec.columns:
        inputs.fail("columns", "missing: a CSV without a header needs the column names in order")
    if spec.columns and (spec.format != "csv" or spec.header):
        inputs.fail("columns", "only a CSV without a header (header: false) takes the column names")
    label = top.get("label", (dict, str), required=True, expect="a column name or a mapping")
    label = _Reader({"column": label} if isinstance(label, str) else label, where, "label",
                    ("column", "positive", "threshold"))
    spec.label = label.get("column", str, required=True, expect="a column name")
    positive = label.get("positive", (list, str, int), expect="a value or a list of values")
    if positive is not None:
        positive = positive if isinstance(positive, list) else [positive]
        if not positive or any(isinstance(v, (list, dict, bool)) or v is None for v in positive):
            label.fail("positive", f"must be a value or a non-empty list of values, got {positive!r}")
        spec.positive = [str(v) for v in positive]
    spec.label_threshold = label.get("threshold", NUMBER, expect="a number")
    if spec.positive is not None and spec.label_threshold is not None:
        label.fail("threshold", "give positive or threshold, not both")
    numerical = top.get("numerical", list, [], expect="a list")
    categorical = top.get("categorical", list, [], expect="a list")
    spec.numerical = [_numerical(item, where, f"numerical[{k}]") for k, item in enumerate(numerical)]
    spec.categorical = [_categorical(item, where, f"categorical[{k}]") for k, item in enumerate(categorical)]
    if not spec.categorical:
        top.fail("categorical", "missing: at least one categorical feature is needed")
    names = [f.name for f in spec.numerical + spec.categorical]
    twice = sorted({n for n in names if names.count(n) > 1} | ({"label"} & set(names)))
    if twice:
        top.fail("", f"feature name {twice[0]!r} is used twice (or is the label's): set `name`")
    for k, c in enumerate(spec.categorical):
        if c.history:
            h = c.history
            r = _Reader(categorical[k], where, f"categorical[{k}]",
                        GAPS_KEYS if h.gaps else SIDE_KEYS if h.aligned_with else HISTORY_KEYS)
            if h.aligned_with:
                _aligned(spec, c, r)
            if not h.gaps:
                _history_of(spec, h.of, r)
    _split(spec, _Reader(top.get("split", dict, {}, expect="a mapping"), where, "split",
                         ("by", "test", "validation", "order", "column", "test_from", "validation_from",
                          "test_files", "validation_files")), base_dir)
    if spec.columns:
        missing = [c for c in spec.columns_used() if c not in spec.columns]
        if missing:
            inputs.fail("columns", f"has no column {missing[0]!r} (the spec uses it)")
    return spec


def _numerical(item, where, key) -> Numerical:
    item = {"column": item} if isinstance(item, str) else item
    r = _Reader(item, where, key, ("column", "name", "transform", "min", "max", "fill"))
    column = r.get("column", str, required=True, expect="a column name")
    f = Numerical(r.get("name", str, column), column,
                  r.get("transform", str, "log", check=lambda v: v in TRANSFORMS, expect=" or ".join(TRANSFORMS)),
                  r.get("min", NUMBER, expect="a number"), r.get("max", NUMBER, expect="a number"),
                  float(r.get("fill", NUMBER, 0.0, expect="a number")))
    if (f.low is not None or f.high is not None) != (f.transform == "clip"):
        r.fail("transform", "clip takes min and/or max; only clip does")
    if f.low is not None and f.high is not None and f.low > f.high:
        r.fail("min", f"{f.low} is above max {f.high}")
    return f


HISTORY_KEYS = ("name", "history_of", "user", "time", "max_length", "only_positive")
SIDE_KEYS = ("name", "history_of", "aligned_with")
GAPS_KEYS = ("name", "gaps_of")


def _categorical(item, where, key) -> Categorical:
    item = {"column": item} if isinstance(item, str) else item
    if isinstance(item, dict) and "gaps_of" in item:
        r = _Reader(item, where, key, GAPS_KEYS)
        of = r.get("gaps_of", str, required=True, expect="a history's name")
        return Categorical(r.get("name", str, f"{of}_gaps"), "", history=History("", "", "", 0, aligned_with=of,
                                                                                 gaps=True))
    if isinstance(item, dict) and "aligned_with" in item:
        r = _Reader(item, where, key, SIDE_KEYS)
        of = r.get("history_of", str, required=True, expect="a categorical feature's name")
        with_ = r.get("aligned_with", str, required=True, expect="a history's name")
        return Categorical(r.get("name", str, f"{with_}_{of}"), "", history=History(of, "", "", 0, aligned_with=with_))
    if isinstance(item, dict) and "history_of" in item:
        return _history(_Reader(item, where, key, HISTORY_KEYS))
    r = _Reader(item, where, key, ("column", "name", "type", "threshold", "buckets", "delimiter", "max_hotness",
                                   "derive"))
    column = r.get("column", str, required=True, expect="a column name")
    positive = lambda v: v > 0      # noqa: E731
    f = Categorical(r.get("name", str, column), column,
                    r.get("type", str, "string", check=lambda v: v in TYPES, expect=" or ".join(TYPES)),
                    r.get("threshold", int, 0, check=lambda v: v >= 0, expect="an integer >= 0"),
                    r.get("buckets", int, check=positive, expect="a positive integer"),
                    r.get("delimiter", str, check=lambda v: len(v) == 1, expect="one character"),
                    r.get("max_hotness", int, check=positive, expect="a positive integer"),
                    r.get("derive", str, check=lambda v: v in DERIVED, expect=" or ".join(DERIVED)))
    if (f.delimiter is None) != (f.max_hotness is None):
        r.fail("max_hotness" if f.delimiter else "delimiter", "a multi-hot column needs both delimiter and max_hotness")
    if f.buckets is not None and f.threshold:
        r.fail("threshold", "a hashed column (buckets) has no vocabulary and no threshold")
    if f.derive and (f.delimiter or "type" in item):
        r.fail("derive", "a derived column is one integer per row (no type, no delimiter)")
    if f.derive:
        f.type = "int"
    return f


def _history(r: _Reader) -> Categorical:
    of = r.get("history_of", str, required=True, expect="a categorical feature's name")
    h = History(of, r.get("user", str, required=True, expect="a column name"),
                r.get("time", str, required=True, expect="a column name"),
                r.get("max_length", int, required=True, check=lambda v: v > 0, expect="a positive integer"),
                r.get("only_positive", bool, False, expect="true or false"))
    return Categorical(r.get("name", str, f"{of}_history"), "", history=h)


def _history_of(spec: RawSpec, of: str, r: _Reader):
    """A history's item feature must be one of the spec's one-hot categorical features."""
    item = next((c for c in spec.categorical if c.name == of), None)
    if item is None:
        names = ", ".join(c.name for c in spec.categorical if not c.history)
        r.fail("history_of", f"{of!r} is not a categorical feature of the spec ({names})")
    if item.history or item.max_hotness:
        r.fail("history_of", f"{of} is {'a history' if item.history else 'multi-hot'}: a history takes the ids of a "
                             "one-hot feature")


def _aligned(spec: RawSpec, c: Categorical, r: _Reader):
    """A side feature takes the user, time, max_length and counting events of the history it is
    aligned with (gaps_of / aligned_with: a history of the spec with an item of its own)."""
    key = "gaps_of" if c.history.gaps else "aligned_with"
    main = next((f for f in spec.categorical if f.name == c.history.aligned_with), None)
    if main is None or not main.history or main.history.aligned_with:
        names = ", ".join(f.name for f in spec.categorical if f.history and not f.history.aligned_with) or "none"
        r.fail(key, f"{c.history.aligned_with!r} is not a history of the spec with items of its own (its histories: "
                    f"{names})")
    h = main.history
    c.history = dataclasses.replace(h, of=c.history.of or h.of, aligned_with=main.name, gaps=c.history.gaps,
                                    counting_item=h.of)


def _split(spec: RawSpec, r: _Reader, base_dir: str):
    spec.split = r.get("by", str, "fraction", check=lambda v: v in ("fraction", "column", "files"),
                       expect="fraction or column or files")
    share = dict(check=lambda v: 0 <= v < 1, expect="a fraction in [0, 1)")
    for name in ("order", "column", "test_from", "validation_from", "test_files", "validation_files"):
        by = "fraction" if name == "order" else "column" if name in ("column", "test_from", "validation_from") \
            else "files"
        if name in r.raw and spec.split != by:
            r.fail(name, f"only a split by {by} takes it")
    if spec.split == "files":
        for name in ("test", "validation"):
            if name in r.raw:
                r.fail(name, "only a split by fraction takes it (a split by files takes test_files, validation_files)")
        spec.test_files = [os.path.join(base_dir, p) for p in r.names("test_files") or []]
        spec.validation_files = [os.path.join(base_dir, p) for p in r.names("validation_files") or []]
        return
    if spec.split == "fraction":
        spec.test, spec.validation = r.get("test", NUMBER, 0.05, **share), r.get("validation", NUMBER, 0.05, **share)
        if spec.test + spec.validation >= 1:
            r.fail("validation", "test + validation must be below 1")
        order = r.names("order")
        if order is not None and sorted(order) != sorted(MAPPINGS):
            r.fail("order", f"must be train, test and validation in some order, got {order!r}")
        spec.order = order and tuple(order)
        return
    for name in ("test", "validation"):
        if name in r.raw:
            r.fail(name, "only a split by fraction takes it (a split by column takes test_from, validation_from)")
    spec.split_column = r.get("column", str, required=True, expect="a column name")
    spec.test_from = r.get("test_from", NUMBER, expect="a number")
    spec.validation_from = r.get("validation_from", NUMBER, expect="a number")
    if spec.test_from is not None and spec.validation_from is not None and spec.test_from > spec.validation_from:
        r.fail("validation_from", f"{spec.validation_from} is below test_from {spec.test_from}")

"""A dump's column file: numpy's own format, read as its pickle reads, and never trusted over it."""

from __future__ import annotations

import dataclasses
import io
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests._fr_synth import Synth
from tether._exceptions import UnsafeDumpError
from tether.analyze import analyze
from tether.analyze.model import _reduce, read_rank
from tether.events.columns import I8, U1, columns_file, encode, parse_columns, read_columns
from tether.events.layout import rank_file
from tether.events.load import load_trace


def _hang(tmp_path: Path, *, columns: bool = True) -> Path:
    job = Synth(4)
    sub = job.group("1", "tp", [1, 3])
    for k in range(5):
        job.collective("all_reduce", sizes=[[4, 2]] if k % 2 else [[8]])
        job.collective("all_gather", group=sub, sizes=[[2]], out_sizes=[[4]])
        job.p2p(0, 2)
    job.collective("all_reduce", skip=[2])
    return job.write(tmp_path / "ev", columns=columns)


def test_numpy_reads_the_column_file_as_tether_wrote_it(tmp_path: Path) -> None:
    ev = _hang(tmp_path)
    got = read_columns(columns_file(ev, 1), rank_file(ev, 1))
    with np.load(columns_file(ev, 1)) as z:
        for block, rows in (("i8", I8), ("u1", U1)):
            arr = z[block]
            assert arr.shape == (len(rows), 11) and arr.dtype == np.dtype(block)
            for k, name in enumerate(rows):
                assert arr[k].tolist() == list(got.cols[name]), name
        assert b'"pickle_size"' in z["header.json"]
    assert got.n == 11 and got.states == ["completed", "started"]


def test_the_column_file_and_the_pickle_give_the_same_diagnosis(tmp_path: Path) -> None:
    with_cols = analyze(_hang(tmp_path / "a"), jobs=0)
    without = analyze(_hang(tmp_path / "b", columns=False), jobs=0)
    assert not list((tmp_path / "b" / "ev").glob("cols_*"))
    assert (with_cols.verdict, with_cols.culprit_ranks) == ("hang", [2])
    assert dataclasses.replace(with_cols, event=without.event) == without


def _corrupt(ev: Path, rank: int, how: str) -> None:
    path = columns_file(ev, rank)
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "stale":  # the pickle rewritten (longer) after its columns were
        dump = rank_file(ev, rank)
        dump.write_bytes(dump.read_bytes() + b"\0")
    else:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename == "i8.npy" and how == "index out of bounds":
                    data = data[:-8] + (10_000).to_bytes(8, "little")  # the last entry's kind
                if info.filename == "i8.npy" and how == "wrong dtype":
                    data = data.replace(b"'<i8'", b"'<i4'", 1)
                if info.filename == "u1.npy" and how == "short row":
                    data = data[:-1]
                if info.filename == "u1.npy" and how == "a flag of 2":
                    data = data[:-1] + b"\x02"  # the last entry's is_p2p
                dst.writestr(info, data)
        path.write_bytes(out.getvalue())


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("truncated", "not a column file"),
        ("stale", "stale (made from a"),
        ("index out of bounds", "its kind row points outside the header's table"),
        ("wrong dtype", "i8.npy is not a 5-row <i8 array"),
        ("short row", "u1.npy holds 39 bytes for 4 x 10 values"),
        ("a flag of 2", "a flag that is neither 0 nor 1"),
    ],
)
def test_a_bad_column_file_is_refused_and_the_dump_read_instead(
    tmp_path: Path, how: str, why: str
) -> None:
    ev = _hang(tmp_path)
    _corrupt(ev, 2, how)
    with pytest.raises(UnsafeDumpError, match=re.escape(why)):
        read_columns(columns_file(ev, 2), rank_file(ev, 2))
    dump = rank_file(ev, 2)
    tr = read_rank(2, dump)
    assert tr.notes and why in tr.notes[0] and "read its dump instead" in tr.notes[0]
    assert dataclasses.replace(tr, notes=[]) == _reduce(2, dump, load_trace(dump))
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), d.evidence
    assert any("read its dump instead" in e for e in d.evidence), d.evidence


def test_only_tether_s_regular_dumps_have_a_columnar_form(tmp_path: Path) -> None:
    job = Synth(2, flavor="torch")
    job.collective("all_reduce")
    assert encode(job.dump(0), pickle_size=1) is None  # torch's own: read as it is
    ours = Synth(2)
    ours.collective("all_reduce")
    data = ours.dump(0)
    assert encode(data, pickle_size=1) is not None
    data["entries"][0]["collective_seq_id"] = None
    assert encode(data, pickle_size=1) is None
    with pytest.raises(UnsafeDumpError, match="not a column file"):
        parse_columns(b"PK\x03\x04 not a zip", source="cols_0.npz", pickle_size=1)

"""A dump's column file: numpy's own format, read as its pickle reads, and never trusted over it."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests._fr_synth import Synth
from tether._exceptions import UnsafeDumpError
from tether.analyze import analyze
from tether.analyze.model import _reduce, read_rank
from tether.events.columns import (
    I4,
    I8,
    U1,
    columns_file,
    encode,
    parse_columns,
    read_columns,
)
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
        for block, rows in (("i8", I8), ("i4", I4), ("u1", U1)):
            arr = z[block]
            assert arr.shape == (len(rows), 11) and arr.dtype == np.dtype(block)
            for k, name in enumerate(rows):
                assert arr[k].tolist() == list(got.cols[name]), name
        assert b'"pickle_size"' in z["header.json"]
    assert got.n == 11 and got.states == ["completed", "started"]
    # Group by group, each in the dump's order: the world's entries, then tp's.
    assert list(got.cols["group"]) == [0] * 6 + [1] * 5
    assert list(got.cols["idx"]) == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9]
    assert got.spans == [(0, 0, 6), (1, 6, 11)]


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
                if how == "compressed":
                    info.compress_type = zipfile.ZIP_DEFLATED
                if info.filename == "i4.npy" and how == "index out of bounds":
                    start = data.index(b"\n") + 1  # the first entry's kind
                    data = data[:start] + (10_000).to_bytes(4, "little") + data[start + 4 :]
                if info.filename == "i4.npy" and how == "an entry twice":
                    data = data[:-4] + (0).to_bytes(4, "little")  # the last entry's idx
                if info.filename == "u1.npy" and how == "groups apart":
                    start = data.index(b"\n") + 1  # the first entry's group, as the last's
                    data = data[:start] + b"\x01" + data[start + 1 :]
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
        ("compressed", "not a column file (a member that is not stored as it is)"),
        ("stale", "stale (made from a"),
        ("index out of bounds", "its kind row points outside its table"),
        ("groups apart", "the entries of group 1 are not stored together"),
        ("wrong dtype", "i8.npy is not a 4-row <i8 array"),
        ("short row", "u1.npy holds 39 bytes for 4 x 10 values"),
        ("a flag of 2", "a flag that is neither 0 nor 1"),
    ],
)
def test_a_bad_column_file_is_refused_and_the_dump_read_instead(
    tmp_path: Path, how: str, why: str
) -> None:
    ev = _hang(tmp_path)
    rank = 3 if how == "groups apart" else 2  # rank 3 is in two groups
    _corrupt(ev, rank, how)
    with pytest.raises(UnsafeDumpError, match=re.escape(why)):
        read_columns(columns_file(ev, rank), rank_file(ev, rank))
    dump = rank_file(ev, rank)
    tr = read_rank(rank, dump)
    assert tr.notes and why in tr.notes[0] and "read its dump instead" in tr.notes[0]
    assert dataclasses.replace(tr, notes=[]) == _reduce(rank, dump, load_trace(dump))
    d = analyze(ev, jobs=0)
    assert (d.verdict, d.culprit_ranks) == ("hang", [2]), d.evidence
    assert any("read its dump instead" in e for e in d.evidence), d.evidence


def test_an_idx_row_that_names_an_entry_twice_is_refused_and_the_dump_read_instead(
    tmp_path: Path,
) -> None:
    ev = _hang(tmp_path)
    _corrupt(ev, 2, "an entry twice")  # rank 2 has p2p: its rows are put back in order
    dump = rank_file(ev, 2)
    tr = read_rank(2, dump)
    assert "its idx row does not number the entries once each" in tr.notes[0], tr.notes
    assert dataclasses.replace(tr, notes=[]) == _reduce(2, dump, load_trace(dump))


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


def test_a_dump_of_collectives_reads_its_groups_as_slices_and_equals_its_pickle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tether.analyze import model

    job = Synth(8, clock_offsets_ns={3: 5_000, 5: -7_000})
    even = job.group("1", "dp0", [0, 2, 4, 6])
    odd = job.group("2", "dp1", [1, 3, 5, 7])
    for k in range(4):
        job.collective("all_reduce", sizes=[[4, 2]] if k % 2 else [[8]])
        job.collective("all_gather", group=even, sizes=[[2]], out_sizes=[[8]])
        job.collective("all_gather", group=odd, sizes=[[2]], out_sizes=[[8]])
    job.collective("all_reduce", skip=[5])

    def in_order(*_: object) -> None:
        raise AssertionError("a dump of collectives read in the dump's order")

    for rank in (0, 3, 5):
        data = job.dump(rank)
        assert data["pg_status"]  # as tether's writer writes it
        columns = parse_columns(encode(data, pickle_size=1) or b"", source="c", pickle_size=1)
        with monkeypatch.context() as m:
            m.setattr(model, "_in_dump_order", in_order)
            sliced = model._reduce_columns(rank, Path("rank_0"), columns)
        assert sliced == model._reduce(rank, Path("rank_0"), data)
        assert list(sliced.groups) == ["0", "1" if rank % 2 == 0 else "2"]


def test_an_evenly_spaced_member_list_is_kept_as_a_run() -> None:
    job = Synth(4096)
    sub = job.group("1", "dp", list(range(3, 4096, 8)))
    job.collective("all_reduce", group=sub)
    data = job.dump(3)
    raw = encode(data, pickle_size=1) or b""
    assert len(raw) < 4096  # the world's 24 KB of member list written as three numbers
    got = parse_columns(raw, source="c", pickle_size=1).header["pg_config"]
    assert got["0"]["ranks"] == range(4096) and got["1"]["ranks"] == range(3, 4096, 8)
    assert read_rank_groups(data) == read_rank_groups(data, columns=True)
    # A run that is not one (a step of 0, a start below 0, more members than a world holds) is
    # refused: the reader would enumerate it.
    for run in ([0, 10, 0], [-1, 10, 1], [0, 1 << 40, 1], [0, 10], [0, "10", 1]):
        bad = _with_world_members(raw, {"range": run})
        with pytest.raises(UnsafeDumpError, match="its header is not a column file's"):
            parse_columns(bad, source="c", pickle_size=1)


def read_rank_groups(data: dict[str, object], *, columns: bool = False) -> object:
    """The members of each group as the analyzer reads them from the pickle or the columns."""
    from tether.analyze import model

    if not columns:
        return model._reduce(3, Path("rank_3"), data).pg_config
    raw = encode(data, pickle_size=1) or b""
    return model._reduce_columns(
        3, Path("rank_3"), parse_columns(raw, source="c", pickle_size=1)
    ).pg_config


def _with_world_members(raw: bytes, ranks: object) -> bytes:
    """``raw``'s column file with its header's world members replaced by ``ranks``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "header.json":
                header = json.loads(data)
                header["dump"]["pg_config"]["0"]["ranks"] = ranks
                data = json.dumps(header).encode()
            dst.writestr(info, data)
    return out.getvalue()

"""Every dtype torch DCP saves, through ckptd and torch DCP both ways, bit-exact; the others refused.

Which dtypes torch DCP saves is found out here by saving and loading one tensor of every
``torch.<name>`` that is a dtype with DCP itself, so a dtype a later torch adds (or drops) is
tested as it comes. Values are random bytes (NaN and other special patterns included): equality
is checked on the bytes, not on values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import ShardingError
from ckptd.format.dcp_metadata import read_index
from ckptd.verify import verify_checkpoint
from tests.cli import offline_cli
from tests.dtypes import ALL_DTYPES, dtype_label, random_tensor, same_bits
from tests.dtypes import dcp_dtypes as dcp_dtypes_of_torch

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore:ComplexHalf support is experimental"
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dcp_dtypes(tmp_path_factory) -> list[torch.dtype]:
    """The dtypes torch DCP saves and loads bit-exact, by trying each."""
    return dcp_dtypes_of_torch(tmp_path_factory.mktemp("dcp-probe"))


def test_the_table_is_every_dtype_torch_dcp_saves(dcp_dtypes):
    from ckptd.format.records import dtype_from_name, dtype_name, supported_dtypes

    assert sorted(supported_dtypes(), key=str) == dcp_dtypes
    # Dtypes a hand-written table once lacked (float8 variants, complex32), and the classics.
    names = {dtype_label(dt) for dt in dcp_dtypes}
    assert {
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "complex32",
        "float8_e4m3fn",
        "uint64",
        "bool",
        "bfloat16",
        "complex128",
    } <= names
    assert all(dtype_from_name(dtype_name(dt)) == dt and dtype_name(dt) == dtype_label(dt) for dt in dcp_dtypes)


def test_every_dcp_dtype_round_trips_ckptd_and_dcp_both_ways(tmp_path, dcp_dtypes):
    ref = {dtype_label(dt): random_tensor(dt, i) for i, dt in enumerate(dcp_dtypes)}
    ckptd.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in ref.items()}, tmp_path / "c", fsync=False)

    # ckptd.load, whole and resharded: row halves (contiguous runs) and column halves (strided).
    whole = ckptd.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in ref.items()}, tmp_path / "c"
    )
    bad = [k for k, v in ref.items() if not same_bits(whole[k], v)]
    for axis in (0, 1):
        for part in (0, 1):
            piece = {k: v.chunk(2, axis)[part] for k, v in ref.items()}
            out = ckptd.load(
                {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v), (axis, part, 2)) for k, v in piece.items()},
                tmp_path / "c",
            )
            bad += [f"{k} axis {axis} part {part}" for k, v in piece.items() if not same_bits(out[k], v)]
    assert bad == []

    # torch DCP reads ckptd's checkpoint.
    out = {k: torch.empty_like(v) for k, v in ref.items()}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert [k for k, v in ref.items() if not same_bits(out[k], v)] == []

    # ckptd reads torch DCP's checkpoint of the same tensors.
    dcp.save(dict(ref), checkpoint_id=str(tmp_path / "d"), no_dist=True)
    out = ckptd.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in ref.items()}, tmp_path / "d"
    )
    assert [k for k, v in ref.items() if not same_bits(out[k], v)] == []

    for directory in ("c", "d"):
        report = verify_checkpoint(tmp_path / directory, deep=True)
        assert report.ok and report.items_decoded == len(ref), report.findings
    # And the command line, deep.
    run = offline_cli("verify", "--deep", tmp_path / "c")
    assert run.returncode == 0 and f"{len(ref)} items decoded" in run.stdout, run.stdout + run.stderr


def test_a_dtype_torch_dcp_cannot_save_is_refused_before_anything_is_written(tmp_path, dcp_dtypes):
    """Sub-byte shells (uint1..7, int1..7), bits* and quantized dtypes: torch DCP cannot save and
    load them, so refusing them loses nothing DCP could store; ckptd says so by key and dtype."""
    refused = [dt for dt in ALL_DTYPES if dt not in dcp_dtypes]
    assert {dtype_label(dt) for dt in refused} >= {"uint1", "int4", "bits8", "bits16", "qint8", "quint4x2"}
    for dtype in refused:
        t = torch.zeros(4, dtype=torch.uint8).view(dtype)
        with pytest.raises(
            ShardingError,
            match=rf"tensor 'layer\.w' has dtype {dtype}, which the torch_dist "
            r"format cannot store.*float8_e4m3fnuz",
        ):
            ckptd.save({"w": ShardedTensor.from_rank_offsets("layer.w", t)}, tmp_path / "c")
        assert not (tmp_path / "c").exists()


def test_a_strided_load_of_misaligned_complex128_elements_does_not_crash(tmp_path):
    """Regression: a column slice of a complex128 chunk whose item sits at an offset of the data
    file that is not a multiple of 16 (torch.save aligns the elements to 64 bytes within the
    item, not within the file) was copied out of a file mapping at that misaligned address:
    SIGSEGV in ``copy_``."""
    c = random_tensor(torch.complex128, 1, (6, 10))  # rows of 5 elements per half: this shape crashed
    for n in range(1, 256):  # the first item's size sets the second one's offset
        directory = tmp_path / f"c{n}"
        ckptd.save(
            {
                "a": ShardedTensor.from_rank_offsets("a", torch.ones(n, dtype=torch.uint8)),
                "c": ShardedTensor.from_rank_offsets("c", c),
            },
            directory,
            fsync=False,
        )
        [chunk] = read_index(directory).tensors["c"].chunks
        if chunk.file_offset % 16:
            break
    else:
        pytest.fail("no save put the complex128 item at an offset that is not a multiple of 16")
    for part in (0, 1):
        piece = c.chunk(2, 1)[part]
        stats = ckptd.LoadStats()
        out = ckptd.load(
            {"c": ShardedTensor.from_rank_offsets("c", torch.empty_like(piece), (1, part, 2))}, directory, stats=stats
        )
        assert same_bits(out["c"], piece) and stats.raw_items == 1


def test_conjugate_and_negative_views_keep_their_values_both_ways(tmp_path):
    """A conjugate (or negative) view is a bit on the tensor, not in its bytes: ckptd saved a
    view of a slice as its storage's bytes (the conjugate lost), and its raw-byte loader read a
    DCP item holding the bit as if it were not there."""
    import warnings

    c = torch.tensor([9 + 9j, 1 + 2j, 3 - 4j, -5 + 6j, 7 + 7j], dtype=torch.complex64)
    views = {"conj": c.conj(), "slice": c[1:3].conj(), "neg": c.conj().imag, "part": c[2:].conj().imag}
    want = {k: v.resolve_conj().resolve_neg() for k, v in views.items()}
    for writer in ("ckptd", "dcp"):
        d = tmp_path / writer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP without a process group says so
            ckptd.save(dict(views), d) if writer == "ckptd" else dcp.save(dict(views), checkpoint_id=d)
            by_dcp = {k: torch.zeros_like(v) for k, v in want.items()}
            dcp.load(by_dcp, checkpoint_id=d)
        by_ckptd = ckptd.load({k: torch.zeros_like(v) for k, v in want.items()}, d)
        for k in want:
            assert torch.equal(by_ckptd[k], want[k]) and torch.equal(by_dcp[k], want[k]), (writer, k)
    sharded = tmp_path / "sharded"
    ckptd.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in views.items()}, sharded)
    assert all(torch.equal(t, want[k]) for k, t in ckptd.load_plain_tensors(sharded).items())

"""The offline commands (ls, inspect, verify, gc, tune) on real checkpoint trees.

Most checks call the commands through an argparse harness built from ``ckptd.commands.ALL`` (the
way ``ckptd.cli`` wires them); a batch of real ``python -m ckptd.commands`` subprocesses checks
exit codes, stdout/stderr separation and the TTY-only progress bar end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd import commands
from ckptd.format.dcp_metadata import read_index, records_from_index
from tests.checkpoints import flip_bit, make_checkpoint, make_partial, make_root

REPO = Path(__file__).resolve().parents[2]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="ckptd")
    sub = parser.add_subparsers()
    for command in commands.ALL:
        command.register(sub)
    args = parser.parse_args([str(a) for a in argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _flip_item(directory: Path, fqn: str) -> dict:
    rec = next(r for r in records_from_index(read_index(directory)) if r.fqn == fqn)
    flip_bit(directory / rec.relative_path, rec.file_offset + rec.length - 100)
    return {"file": rec.relative_path, "offset": rec.file_offset, "length": rec.length}


# ---------------------------------------------------------------- in-process harness


def test_help_everywhere(capsys):
    from ckptd.cli import build_parser

    parser = build_parser()
    names = set(parser._subparsers._group_actions[0].choices)  # every registered command
    assert names == {"daemon", "status", "ls", "inspect", "verify", "convert", "bench", "gc", "tune"}
    for name in sorted(names):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0
        assert "exit status" in capsys.readouterr().out, name


def test_ls(tmp_path, capsys):
    root = make_root(tmp_path / "r", [100, 200], latest=200)
    make_partial(root, 300, age_s=0)
    rc, out, err = cli(capsys, "ls", root)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{root}  (latest: iter_0000200)"
    assert any(line.startswith("*") and "iter_0000200" in line and "committed" in line for line in lines)
    assert any("iter_0000300.tmp" in line and "partial" in line and not line.startswith("*") for line in lines)
    rc, out, _ = cli(capsys, "ls", root, "--json")
    data = json.loads(out)
    assert rc == 0 and data["latest"] == "iter_0000200"
    assert [(c["name"], c["step"], c["state"], c["latest"]) for c in data["checkpoints"]] == [
        ("iter_0000100", 100, "committed", False),
        ("iter_0000200", 200, "committed", True),
        ("iter_0000300.tmp", 300, "partial", False),
    ]
    assert data["checkpoints"][1]["nbytes"] == sum(p.stat().st_size for p in (root / "iter_0000200").iterdir())
    rc, out, _ = cli(capsys, "ls", root / "iter_0000100", "--json")  # a single checkpoint
    assert rc == 0 and [c["name"] for c in json.loads(out)["checkpoints"]] == ["iter_0000100"]
    (root / "latest").write_text("iter_0000900\n")
    rc, _, err = cli(capsys, "ls", root)
    assert rc == 1 and "iter_0000900" in err and "does not exist" in err


def test_convert_consolidate(tmp_path, capsys):
    import torch

    ref = make_checkpoint(tmp_path / "ck")
    rc, out, err = cli(capsys, "convert", "consolidate", tmp_path / "ck", tmp_path / "model.pt", "--no-fsync")
    assert rc == 0 and err == "" and f"wrote {len(ref)} tensors" in out
    got = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    calls: list[int] = []  # what a progress bar is fed: bytes per batch, adding up to the total
    from ckptd import load_plain_tensors

    batched = load_plain_tensors(tmp_path / "ck", progress=calls.append, batch_nbytes=1)
    assert len(calls) == len(ref) and sum(calls) == sum(t.nbytes for t in ref.values())
    assert all(torch.equal(batched[k], ref[k]) for k in ref)
    rc, _, err = cli(capsys, "convert", "consolidate", tmp_path / "nothing", tmp_path / "m2.pt")
    assert rc == 1 and "ckptd convert: error:" in err and not (tmp_path / "m2.pt").exists()


def test_convert_consolidate_never_writes_into_the_checkpoint_or_over_a_file(tmp_path, capsys):
    """`consolidate CKPT CKPT/__0_0.distcp` replaced the checkpoint's data file with the
    consolidated one (and any existing output was replaced without a word)."""
    import torch

    from ckptd import load_plain_tensors

    ck = tmp_path / "ck"
    ref = make_checkpoint(ck)
    files = {p.name: p.read_bytes() for p in ck.iterdir()}
    (tmp_path / "link").symlink_to(ck)
    (tmp_path / "data-link.pt").symlink_to(ck / "__0_0.distcp")
    for out in (ck / "__0_0.distcp", ck / "model.pt", tmp_path / "link" / "model.pt", tmp_path / "data-link.pt", ck):
        rc, _, err = cli(capsys, "convert", "consolidate", ck, out, "--overwrite", "--no-fsync")
        assert rc == 1 and "inside the checkpoint" in err and "elsewhere" in err, (out, err)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == files
    assert (tmp_path / "data-link.pt").is_symlink()
    out = tmp_path / "model.pt"
    out.write_bytes(b"mine")
    rc, _, err = cli(capsys, "convert", "consolidate", ck, out, "--no-fsync")
    assert rc == 1 and "already exists" in err and "--overwrite" in err and out.read_bytes() == b"mine", err
    rc, stdout, err = cli(capsys, "convert", "consolidate", ck, out, "--overwrite", "--no-fsync")
    assert rc == 0 and f"wrote {len(ref)} tensors" in stdout, err
    got = torch.load(out, weights_only=True)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert all(torch.equal(t, ref[k]) for k, t in load_plain_tensors(ck).items())


def test_convert_consolidate_includes_or_names_sharded_objects(tmp_path, capsys):
    """ShardedObjects (Megatron's RNG states, `_extra_state`) were dropped, even --with-common."""
    import torch

    ref = make_checkpoint(tmp_path / "ck")  # each of its two ranks stores a shard of "rng"
    rc, out, err = cli(capsys, "convert", "consolidate", tmp_path / "ck", tmp_path / "bare.pt", "--no-fsync")
    assert rc == 0 and "left out 2 ShardedObjects (--with-common includes them)" in out, (out, err)
    assert "rng/shard_0_2" in out and "rng/shard_1_2" in out
    assert set(torch.load(tmp_path / "bare.pt", weights_only=True)) == set(ref)
    argv = ["convert", "consolidate", tmp_path / "ck", tmp_path / "all.pt", "--with-common", "--no-fsync"]
    rc, out, err = cli(capsys, *argv)
    assert rc == 0 and f"wrote {len(ref)} tensors and 2 objects" in out, (out, err)
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    assert got["objects"] == {"rng/shard_0_2": {"rank": 0, "seed": 1234}, "rng/shard_1_2": {"rank": 1, "seed": 1235}}
    assert got["common"]["iteration"] == 7 and set(got["state_dict"]) == set(ref)


def test_convert_to_dist_reads_an_expert_parallel_tree_whose_files_need_unsafe_pickles(tmp_path, capsys):
    """`mp_rank_00_001` of a TP x EP tree with numpy RNG states was taken for a pipeline stage
    (expert rank 1's experts lost, its layers renumbered as 4..7), exit 0."""
    import torch

    from ckptd import load_plain_tensors
    from tests.unit.test_convert_legacy import reference, write_legacy_tree

    ref = reference(experts=True)
    write_legacy_tree(tmp_path / "legacy", ref, tp=1, pp=1, ep=2, numpy_rng=True)
    rc, _, err = cli(capsys, "convert", "to-dist", tmp_path / "legacy", tmp_path / "no", "--no-fsync")
    assert rc == 1 and "--allow-unsafe-pickle" in err and not (tmp_path / "no").exists(), err
    argv = ["convert", "to-dist", tmp_path / "legacy", tmp_path / "dist", "--allow-unsafe-pickle", "--no-fsync"]
    rc, out, err = cli(capsys, *argv)
    assert rc == 0 and f"converted {len(ref)} tensors" in out, err
    plain = load_plain_tensors(tmp_path / "dist")
    assert sorted(plain) == sorted(ref) and all(torch.equal(plain[k], ref[k]) for k in ref)


def test_bench_checksums_runs_and_cleans_up(tmp_path, capsys):
    rc, out, _ = cli(
        capsys, "bench", "checksums", "--gib", "0.01", "--item-mib", "2", "--repeats", "1", "--dir", tmp_path
    )
    assert rc == 0 and "time ratio on/off" in out and "verify_checkpoint" in out
    assert list(tmp_path.iterdir()) == []


def test_inspect(tmp_path, capsys):
    root = make_root(tmp_path / "r", [5], latest=5)
    rc, out, err = cli(capsys, "inspect", root)
    assert rc == 0 and err == ""
    assert f"checkpoint {root / 'iter_0000005'}" in out
    weight = next(line for line in out.splitlines() if line.startswith("layer.weight"))
    assert "float32" in weight and "(8, 6)" in weight and "2x(4, 6)" in weight
    assert "__0_0.distcp, __1_0.distcp" in weight
    assert "checksums: 6 of 6 items" in out and "iteration: int" in out and "rng/shard_1_2" in out
    rc, out, _ = cli(capsys, "inspect", root / "iter_0000005", "--json")
    data = json.loads(out)
    w = next(t for t in data["tensors"] if t["key"] == "layer.weight")
    assert (w["chunks"], w["chunk_shapes"], w["files"]) == (
        2,
        [{"shape": [4, 6], "count": 2}],
        ["__0_0.distcp", "__1_0.distcp"],
    )
    emb = next(t for t in data["tensors"] if t["key"] == "embedding")
    assert emb["dtype"] == "bfloat16" and emb["nbytes"] == 32
    assert data["common"] == {"iteration": "int", "note": "str"}
    assert sorted(o["key"] for o in data["objects"]) == ["rng/shard_0_2", "rng/shard_1_2"]
    (root / "iter_0000005" / ".metadata").unlink()
    rc, _, err = cli(capsys, "inspect", root / "iter_0000005")
    assert rc == 1 and ".metadata" in err and "missing" in err


def test_verify_sound_and_damaged(tmp_path, capsys):
    make_checkpoint(tmp_path / "c")
    rc, out, err = cli(capsys, "verify", tmp_path / "c", "--deep")
    assert rc == 0 and err == "" and out.startswith(f"{tmp_path / 'c'}: OK")
    assert "6 checksums checked; 6 items decoded" in out
    where = _flip_item(tmp_path / "c", "embedding")
    rc, out, _ = cli(capsys, "verify", tmp_path / "c", "--json")
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    [finding] = report["findings"]
    assert finding["check"] == "checksum" and finding["item"] == "embedding chunk (0, 0)"
    assert {k: finding[k] for k in where} == where
    rc, out, _ = cli(capsys, "verify", tmp_path / "c")
    assert rc == 1 and "DAMAGED (1 error)" in out and "ERROR   [checksum] embedding chunk (0, 0)" in out


def test_verify_root(tmp_path, capsys):
    root = make_root(tmp_path / "r", [1, 2], latest=2)
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 0 and str(root / "iter_0000002") in out and "iter_0000001" not in out
    (root / "iter_0000001" / "__1_0.distcp").unlink()  # older checkpoint damaged
    assert cli(capsys, "verify", root)[0] == 0
    rc, out, _ = cli(capsys, "verify", root, "--all", "--json")
    data = json.loads(out)
    assert rc == 1 and [c["ok"] for c in data["checkpoints"]] == [False, True]
    assert data["checkpoints"][0]["findings"][0]["file"] == "__1_0.distcp"
    # A committed name that lost both markers (.metadata, metadata.json) was skipped by --all.
    (root / "iter_0000001" / "metadata.json").unlink()
    (root / "iter_0000001" / ".metadata").unlink()
    rc, out, _ = cli(capsys, "verify", root, "--all", "--json")
    data = json.loads(out)
    assert rc == 1 and [c["ok"] for c in data["checkpoints"]] == [False, True]
    (root / "latest").write_text("iter_0000003\n")
    rc, out, _ = cli(capsys, "verify", root)
    assert rc == 1 and "[tracker]" in out and "iter_0000003" in out


def test_usage_errors_exit_2(tmp_path, capsys):
    make_checkpoint(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    for argv in (
        ("verify", tmp_path / "missing"),
        ("verify", tmp_path / "empty"),
        ("inspect", tmp_path / "empty"),
        ("ls", tmp_path / "missing"),
        ("verify", tmp_path / "c", "--all"),
        ("gc", tmp_path / "c", "--keep", "1"),
        ("gc", tmp_path / "empty", "--keep", "0"),
        ("gc", tmp_path / "c"),
        ("tune", "--stall-s", "1", "--persist-s", "1", "--mtbf-s", "0"),
        ("verify", "gs://bucket/ckpt"),  # a scheme ckptd does not store at (it exited 1)
        ("ls", "s3://B/ckpt"),  # no S3 bucket name
    ):
        rc, out, err = cli(capsys, *argv)
        assert rc == 2, argv
        assert out == "" and err.startswith(f"ckptd {argv[0]}: error: "), (argv, err)
    with pytest.raises(SystemExit) as exc:
        cli(capsys, "tune", "--stall-s", "1")  # required arguments missing: argparse's own exit 2
    assert exc.value.code == 2


def test_gc(tmp_path, capsys):
    root = make_root(tmp_path / "r", [100, 200, 300], latest=200)
    make_partial(root, 50, age_s=7200)
    make_partial(root, 400, age_s=1)
    before = sorted(p.name for p in root.iterdir())
    rc, out, _ = cli(capsys, "gc", root, "--keep", "1", "--dry-run")
    assert rc == 0 and sorted(p.name for p in root.iterdir()) == before
    assert "would remove iter_0000050.tmp" in out and "would remove iter_0000100 " in out
    assert "kept iter_0000200: named by the tracker" in out and "kept iter_0000400.tmp: save may be in flight" in out
    rc, out, _ = cli(capsys, "gc", root, "--keep", "1", "--json")
    data = json.loads(out)
    assert rc == 0 and [r["name"] for r in data["removed"]] == ["iter_0000050.tmp", "iter_0000100"]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000200", "iter_0000300", "iter_0000400.tmp", "latest"]
    rc, out, _ = cli(capsys, "gc", root, "--keep", "1", "--grace-s", "0")
    assert rc == 0 and "removed iter_0000400.tmp" in out and "removed 1 directory" in out
    (root / "latest").write_text("garbage/\n")
    rc, out, err = cli(capsys, "gc", root, "--keep", "1")
    assert rc == 1 and "removed 0 directories" in out and "left alone" in err


def test_gc_without_keep_removes_only_leftovers(tmp_path, capsys):
    """``ckptd gc ROOT`` (no --keep) cleans abandoned saves and interrupted removals and never
    removes a committed checkpoint, also when the tracker cannot be trusted."""
    root = make_root(tmp_path / "r", [100, 200, 300], latest=200)
    make_partial(root, 50, age_s=7200)
    make_partial(root, 400, age_s=1)
    (root / "iter_0000010.deleting").mkdir()
    rc, out, _ = cli(capsys, "gc", root)
    assert rc == 0, out
    assert "removed iter_0000010.deleting" in out and "removed iter_0000050.tmp" in out
    assert "kept iter_0000100: committed" in out and "kept iter_0000300: committed" in out
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000100",
        "iter_0000200",
        "iter_0000300",
        "iter_0000400.tmp",
        "latest",
    ]
    (root / "latest").write_text("iter_0000999\n")  # dangling: nothing committed was at stake anyway
    rc, out, err = cli(capsys, "gc", root, "--grace-s", "0")
    assert rc == 0 and err == "" and "removed iter_0000400.tmp" in out and "removed 1 directory" in out
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000100", "iter_0000200", "iter_0000300", "latest"]


def test_tune(capsys):
    rc, out, _ = cli(capsys, "tune", "--stall-s", "0.5", "--persist-s", "20", "--mtbf-s", "21600", "--step-s", "1.2")
    assert rc == 0 and "Young" in out and "every 123 steps" in out
    rc, out, _ = cli(capsys, "tune", "--stall-s", "0.01", "--persist-s", "30", "--mtbf-s", "3600", "--json")
    data = json.loads(out)
    assert rc == 0 and data["recommendation"]["bound_by_persist"] is True
    assert data["recommendation"]["interval_s"] == pytest.approx(30.0)
    assert any("never queue" in line for line in data["explanation"])


# ---------------------------------------------------------------- real subprocesses


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.timeout(120)
def test_real_subprocesses(tmp_path):
    """Several ``python -m ckptd.commands`` runs at once (each pays the torch import)."""
    root = make_root(tmp_path / "r", [10, 20, 30], latest=30)
    make_checkpoint(tmp_path / "bad")
    where = _flip_item(tmp_path / "bad", "layer.bias")
    runs = {
        "verify_ok": ["verify", root, "--deep"],
        "verify_bad": ["verify", tmp_path / "bad", "--json"],
        "ls": ["ls", root, "--json"],
        "gc": ["gc", root, "--keep", "2"],
        "tune": ["tune", "--stall-s", "1", "--persist-s", "5", "--mtbf-s", "3600"],
        "missing": ["inspect", tmp_path / "nope"],
        "help": ["verify", "--help"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "ckptd.commands", *map(str, argv)],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in runs.items()
    }
    res = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=100)
            res[name] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    rc, out, err = res["verify_ok"]
    assert (rc, err) == (0, "") and "iter_0000030: OK" in out
    rc, out, err = res["verify_bad"]
    [finding] = json.loads(out)["findings"]
    assert rc == 1 and err == "" and finding["check"] == "checksum" and finding["item"] == "layer.bias chunk (0,)"
    assert {k: finding[k] for k in where} == where
    rc, out, _ = res["ls"]
    assert rc == 0 and json.loads(out)["latest"] == "iter_0000030"
    rc, out, _ = res["gc"]
    assert rc == 0 and "removed iter_0000010" in out and not (root / "iter_0000010").exists()
    assert (root / "iter_0000020").is_dir() and (root / "iter_0000030").is_dir()
    rc, out, _ = res["tune"]
    assert rc == 0 and "recommended interval" in out
    rc, out, err = res["missing"]
    assert rc == 2 and out == "" and "does not exist" in err
    rc, out, _ = res["help"]
    assert rc == 0 and "usage: ckptd verify" in out and "--deep" in out


@pytest.mark.timeout(60)
def test_progress_bar_only_on_a_terminal(tmp_path):
    make_checkpoint(tmp_path / "c")
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "ckptd.commands", "verify", str(tmp_path / "c")],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
        )
        os.close(slave)
        slave = -1
        out, _ = p.communicate(timeout=50)
        tty = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            tty += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert p.returncode == 0 and ": OK" in out and "\r" not in out  # stdout is a pipe: no bar there
    assert b"verify c:" in tty and b"100%" in tty

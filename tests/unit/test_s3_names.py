"""Which objects of an uncommitted ``s3://`` step a Checkpointer wrote, by their names: only those
are a crashed attempt's leftovers; a checkpoint another tool wrote there (ckptd.save names its data
object ``__0_0.<12 hex>.distcp``, torch DCP ``__0_0.distcp``) never is."""

from __future__ import annotations

from ckptd.roots.s3_names import attempt_of, ckptd_named, foreign_checkpoint, removable, why_kept

ATTEMPT = "0123456789ab-1"


def test_only_a_save_attempts_id_is_an_attempt():
    assert attempt_of(f"iter_0000010/__3_0.{ATTEMPT}.distcp") == ATTEMPT
    assert attempt_of(f"iter_0000010/__0_0.{ATTEMPT}-m0a1b2c3d.distcp") == f"{ATTEMPT}-m0a1b2c3d"  # a mirror copy's
    assert attempt_of("iter_0000010/__0_0.x-m0a1b2c3d.distcp") == "x-m0a1b2c3d"
    assert attempt_of("iter_0000010/__0_0.54a477811d26.distcp") is None  # ckptd.save's token
    assert attempt_of("iter_0000010/__0_0.distcp") is None  # torch DCP's
    assert attempt_of("iter_0000010/__0_0.anything.distcp") is None
    assert ckptd_named("iter_0000010/ckptd_copy.0123456789ab-1-m0a1b2c3d.node1.json")
    assert not ckptd_named("iter_0000010/__0_0.distcp")


def test_metadata_is_a_crashed_attempts_only_next_to_an_attempts_data_and_nothing_else():
    crashed = [f"s/__0_0.{ATTEMPT}.distcp", "s/.metadata", "s/common.pt"]
    assert foreign_checkpoint(crashed) == []
    assert foreign_checkpoint([f"s/__0_0.{ATTEMPT}.distcp"]) == []  # no metadata: no checkpoint
    assert foreign_checkpoint(["s/__0_0.distcp"]) == []
    saved = ["s/__0_0.54a477811d26.distcp", "s/.metadata", "s/common.pt", "s/metadata.json"]
    assert foreign_checkpoint(saved) == ["__0_0.54a477811d26.distcp"]
    assert foreign_checkpoint([*saved, f"s/__1_0.{ATTEMPT}.distcp"]) == ["__0_0.54a477811d26.distcp"]
    assert foreign_checkpoint(["s/.metadata", "s/__0_0.distcp"]) == ["__0_0.distcp"]  # torch DCP
    assert foreign_checkpoint(["s/.metadata"]) == [".metadata"]  # metadata alone: in doubt, kept


def test_what_recovery_keeps_is_named_with_what_to_do():
    assert why_kept("s3://b/r/s", [f"s/__0_0.{ATTEMPT}.distcp", "s/.metadata"]) is None
    assert why_kept("s3://b/r/s", [f"s/__0_0.{ATTEMPT}.distcp"]) is None
    why = why_kept("s3://b/r/s", ["s/__0_0.distcp", "s/.metadata"])
    assert why is not None and why.startswith("s3://b/r/s holds checkpoint metadata next to objects")
    assert "__0_0.distcp" in why and "remove it by hand" in why and "a save of its step fails" in why
    alone = why_kept("s3://b/r/s", ["s/metadata.json"])
    assert alone is not None and "metadata.json but no data object of a Checkpointer's save" in alone
    left = why_kept("s3://b/r/s", ["s/__0_0.distcp"])
    assert left is not None and "left to their writer" in left


def test_an_attempts_removal_takes_metadata_only_next_to_its_data_and_nothing_of_another_tool():
    """ckptd.save writes common.pt before .metadata: a start caught in between (no checkpoint
    metadata yet) removed its common.pt, and the save then completed without it."""
    data = f"s/__0_0.{ATTEMPT}.distcp"
    assert removable([data, "s/common.pt", "s/.metadata"]) == [data, "s/common.pt", "s/.metadata"]
    assert removable(["s/__0_0.54a477811d26.distcp", "s/common.pt"]) == []  # ckptd.save, before its .metadata
    assert removable([data, "s/__0_0.54a477811d26.distcp", "s/common.pt"]) == [data]
    assert removable(["s/common.pt"]) == []  # no attempt's data beside it: not provably ckptd's
    assert removable(["s/__0_0.distcp", "s/.metadata"]) == []  # torch DCP

"""The crash matrix's checks of a job on node-local disks with a mirror (``tools/crash_matrix.py
--netns --node-local``; ckptd.roots.nodelocal): no node holds a whole checkpoint, so the root
check of tools/harness/crash_trial.py becomes, for the disks as the host reaches them and the
mirror:

- node 0's disk (the commit authority) shows no partial checkpoint; each of its committed steps,
  joined with the other nodes' files of that commit (their ``iter_N/`` when it holds the commit,
  else the attempt's directory a node left before its own rename), loads bit-exact, unless a
  node holding part of it was replaced (a ``machine`` victim boots with an empty disk);
- every checkpoint committed in the mirror loads bit-exact and passes ``ckptd verify``;
- every step a rank saw COMMITTED is still on node 0's disk or in the mirror, unless retention
  removed it after newer ones, or it lived only on a replaced machine's disk and had not been
  mirrored yet (what a node-local disk cannot survive: README, Two tiers);
- the newest step committed before the kill that survived is what the restart must resume from;
  when none did (a machine replaced before the first copy), every restarted rank must refuse to
  resume with the reason (:func:`unrecoverable_as_expected`), never start over silently.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ckptd.catalog import EntryState, scan_root
from ckptd.format.commitrecord import read_commit_record
from ckptd.format.rootlayout import step_dir_name, tmp_dir_name
from ckptd.roots.nodelocal import NODE_FILES
from ckptd.s3catalog import scan_any
from ckptd.storage.url import parse_location
from tools.harness import crash_job as cj

from .crash_trial import KEEP_LAST, TrialResult, _verify_all, check_checkpoint


def _joined(disks: list[Path], step: int, into: Path) -> tuple[Path | None, list[str]]:
    """Node 0's committed ``iter_<step>`` with every node's data files of that commit copied into
    ``into``; (None, files found on no disk) when some are missing."""
    name = step_dir_name(step)
    src = disks[0] / name
    record = read_commit_record(src)
    if record is None or not record.objects:
        return None, [f"{src} has no node-local commit record"]
    dest = into / name
    dest.mkdir()
    for file_name in NODE_FILES:
        shutil.copy(src / file_name, dest / file_name)
    missing = []
    for file_name in record.objects:
        places = []
        for disk in disks:
            held = read_commit_record(disk / name)
            if held is not None and (held.step, held.attempt) == (step, record.attempt):
                places.append(disk / name / file_name)
            places.append(disk / tmp_dir_name(step, record.attempt) / file_name)
        found = next((p for p in places if p.is_file()), None)
        if found is None:
            missing.append(file_name)
        else:
            shutil.copy(found, dest / file_name)
    return (None, missing) if missing else (dest, [])


def check_node_local(
    disks: list[Path], mirror: str, ranks: int, committed: list[int], replaced: list[int], result: TrialResult
) -> set[int]:
    """The checks of the module docstring (findings go into ``result``); returns the steps that
    survived (loadable from the disks joined, or from the mirror)."""
    cat = scan_root(disks[0], usage=False)
    for e in cat.entries:
        if e.state is EntryState.INCOMPLETE:
            result.corrupt.append(f"node 0: {e.name}: a final checkpoint name without its commit marker")
    local = sorted(e.step for e in cat.committed if e.step >= 0)
    loadable_locally = set()
    with tempfile.TemporaryDirectory(prefix="crash-joined-") as tmp:
        for step in local:
            joined, missing = _joined(disks, step, Path(tmp))
            if joined is None:
                if not replaced:  # else: part of it was on a replaced machine's disk
                    result.corrupt.append(f"node 0's {step_dir_name(step)}: files {missing} are on no node's disk")
                continue
            bad = check_checkpoint(joined, step, ranks)
            if bad:
                result.corrupt.append(f"node-local {bad}")
            else:
                loadable_locally.add(step)
            shutil.rmtree(joined)
    mirror_root = parse_location(mirror)
    mirrored = sorted(e.step for e in scan_any(mirror_root, usage=False).committed if e.step >= 0)
    if mirrored:
        verify = _verify_all(mirror_root)
        if verify["rc"] != 0:
            result.corrupt.append(f"ckptd verify of the mirror exited {verify['rc']}")
    for step in mirrored:
        bad = check_checkpoint(mirror_root.child(step_dir_name(step)), step, ranks)
        if bad:
            result.corrupt.append(f"mirror {bad}")
    surviving = loadable_locally | set(mirrored)
    for step in committed:
        if step in surviving:
            continue
        if len([s for s in local if s > step]) >= KEEP_LAST:
            continue  # retention removed it after newer ones committed
        if replaced:
            continue  # part of it was only on a replaced machine's disk, never mirrored: lost with it
        result.lost_committed.append(
            f"step {step} was reported COMMITTED but neither the nodes' disks nor the mirror hold it whole"
        )
    return surviving


def unrecoverable_as_expected(
    events: list[cj.Event], ranks: int, newest: int | None, replaced: list[int], result: TrialResult
) -> bool:
    """Whether the restart refused to resume (every rank, with the reason that the commits went with
    a replaced disk) where it had to: no committed step survived; a refusal anywhere else is a
    finding. False when no rank refused (the usual restart checks apply)."""
    refused = {e.rank: e.detail for e in events if e.phase == "restart" and e.ev == "unrecoverable"}
    if not refused:
        return False
    if newest is None and replaced and len(refused) == ranks and all("cannot be loaded" in d for d in refused.values()):
        result.recovered = True  # the right outcome: a clear error, nothing loaded
        return True
    result.problems.append(f"restarted ranks refused to resume: {refused}")
    return True

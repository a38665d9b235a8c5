"""What the coordinator's commit thread does with an ``s3://`` root, for tests that drive it directly."""

from __future__ import annotations

import io

import torch

from ckptd.format.finalize import serialize_common
from ckptd.format.records import BYTES, ItemRecord
from ckptd.roots.base import CommitOutcome
from ckptd.roots.s3_root import S3Root


def commit_one_rank(root: S3Root, step: int, attempt: str) -> CommitOutcome:
    """Upload one rank's data object of ``step`` (a value naming the step) under ``attempt`` and
    commit it, as the coordinator commits a one-rank save."""
    name, file_name = f"iter_{step:07d}", f"__0_0.{attempt}.distcp"
    buf = io.BytesIO()
    torch.save(f"value of step {step}", buf)
    data = buf.getvalue()
    root.client.put(f"{name}/{file_name}", data)
    record = ItemRecord(fqn="v", kind=BYTES, rank=0, relative_path=file_name, file_offset=0, length=len(data))
    return root.commit(step, attempt, [record], serialize_common({"iteration": step}), {file_name: (0, len(data))})

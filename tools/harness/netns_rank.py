"""A crash-matrix trainer rank inside a namespace node: ``python -m tools.harness.netns_rank SPEC RANK PHASE``.

``SPEC`` is the trial's :class:`tools.harness.crash_job.JobSpec` as JSON; the rank runs
:func:`tools.harness.crash_job.trainer` and exits 0 when it returns.
"""

from __future__ import annotations

import json
import sys

from tools.harness import crash_job as cj


def main(argv: list[str]) -> int:
    spec_json, rank, phase = argv
    fields = json.loads(spec_json)
    fields["node_runtime_dirs"] = tuple(fields["node_runtime_dirs"])
    cj.trainer(int(rank), cj.JobSpec(**fields), phase)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

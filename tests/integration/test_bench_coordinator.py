"""``ckptd bench coordinator`` at small sizes: the load generator plays ranks on several node
connections against a real coordinator process (real CurveZMQ, records and data files), every save
commits, and the report holds each size's figures. Speed is the bench's to report, never asserted
here."""

from __future__ import annotations

import json

import pytest

from benchmarks import coordinator as bc
from ckptd.cli import main as ckptd_cli


@pytest.mark.timeout(180)
def test_bench_coordinator_small(tmp_path, capsys):
    rc = ckptd_cli(
        [
            "bench",
            "coordinator",
            "--ranks",
            "6,12",
            "--ranks-per-node",
            "4",
            "--items-per-rank",
            "3",
            "--commits",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    points = report["points"]
    assert [p["ranks"] for p in points] == [6, 12]
    assert [p["nodes"] for p in points] == [2, 3]  # 6 ranks on 4-rank nodes: 2 connections
    for p in points:
        assert p["records"] == 3 * p["ranks"]
        assert p["messages"] == p["ranks"] + p["nodes"]  # a WRITTEN per rank, a verdict per node
        assert p["metadata_nbytes"] > 0 and p["wire_nbytes"] > 0 and p["rss_mib"] > 0
        assert 0 < p["latency_min_s"] <= p["latency_s"] <= p["latency_max_s"] and p["coordinator_cpu_s"] >= 0
    assert points[1]["metadata_nbytes"] > points[0]["metadata_nbytes"]
    assert set(report["fit"]) == {"intercept_s", "per_rank_s"} and report["extrapolated"]["ranks"] == 10_000
    assert not list(tmp_path.iterdir())  # roots, runtime directories and files removed


def test_bench_coordinator_targets():
    def point(ranks: int, latency_s: float) -> bc.Point:
        return bc.Point(ranks, ranks // 8, ranks * 4, latency_s, latency_s, latency_s, 0.0, 0.0, 0.0, 0, 0, 0, 0.0)

    linear = [point(64, 0.01), point(256, 0.04), point(4096, 0.64)]
    assert bc.missed_targets(linear) == []
    a, b = bc.linear_fit(linear)
    assert abs(a) < 1e-9 and abs(b - 0.01 / 64) < 1e-12
    missed = bc.missed_targets([point(1024, 0.1), point(4096, 1.2)])
    assert any("faster than the ranks" in m for m in missed) and any("at 4096 ranks" in m for m in missed)

"""The digest of a rank's common state (ckptd.statedict.digest), which a save compares across ranks
to say whose common state differs from rank 0's (the one saved)."""

from __future__ import annotations

import logging

import torch

from ckptd.statedict.digest import common_digest, differing_ranks


def test_equal_values_digest_alike_and_different_ones_do_not():
    assert common_digest({"step": 5, "t": torch.arange(4.0)}) == common_digest({"step": 5, "t": torch.arange(4.0)})
    assert common_digest({"step": 5}) != common_digest({"step": 6})
    assert differing_ranks([common_digest({"s": 1}), common_digest({"s": 1}), common_digest({"s": 2})]) == [2]


def test_conjugate_negative_and_sparse_tensors_are_digested_by_their_values(caplog):
    """A conjugate view's bytes could not be viewed: the digest was None, and the whole check was
    skipped without a word (a rank whose step differed went unnoticed)."""
    z = torch.tensor([1 + 2j, 3 - 4j])
    assert common_digest({"c": z.conj()}) == common_digest({"c": z.conj().resolve_conj()}) != common_digest({"c": z})
    x = torch.tensor([1.0, -2.0])
    assert common_digest({"n": torch._neg_view(x)}) == common_digest({"n": -x})
    sparse = torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse()
    assert common_digest({"s": sparse}) is not None and common_digest({"s": sparse}) != common_digest({"s": sparse * 2})
    with caplog.at_level(logging.WARNING, logger="ckptd.statedict.digest"):
        assert common_digest({"f": lambda: 1}) is None
    assert "whether ranks differ is not checked" in caplog.text

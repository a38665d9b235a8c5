"""Which tensors a lazy snapshot copies inside save() with an optimizer attached (ckptd.staging.owned)."""

from __future__ import annotations

import torch

from ckptd.format.items import PlannedItem
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.staging.owned import SMALL_NBYTES, OwnedStorages, copy_unowned


def _item(key: str, t: torch.Tensor) -> PlannedItem:
    rec = ItemRecord(fqn=key, kind=TENSOR, rank=0, dtype="float32", global_shape=tuple(t.shape))
    return PlannedItem(rec, t)


def test_small_tensors_the_optimizer_does_not_own_are_copied_now():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    big = torch.zeros(SMALL_NBYTES // 4 + 1)  # over SMALL_NBYTES: stays lazy
    sd = model.state_dict()
    items = [_item(k, v) for k, v in sd.items()] + [
        _item("big", big),
        _item("exp_avg", opt.state[model[0].weight]["exp_avg"]),
    ]
    owned = OwnedStorages().of([opt])
    out = copy_unowned(items, owned)
    copied = {i.record.fqn for i, o in zip(items, out) if o.payload is not i.payload}
    assert copied == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for i, o in zip(items, out):
        assert torch.equal(o.payload, i.payload) and o.payload.dtype == i.payload.dtype
    sd["1.running_mean"].add_(1.0)  # the forward pass after save(): the copy keeps the value
    assert not torch.equal(out[2].payload, sd["1.running_mean"])


def test_owned_storages_are_read_again_once_the_optimizers_state_appears():
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([w])
    owned = OwnedStorages()
    assert owned.of([opt]) == {w.untyped_storage().data_ptr()}
    w.grad = torch.ones(4)
    opt.step()
    state = opt.state[w]
    assert state["exp_avg"].untyped_storage().data_ptr() in owned.of([opt])

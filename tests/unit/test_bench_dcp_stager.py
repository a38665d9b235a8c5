"""The benchmark's reused DCP stager stages every save on torch 2.11/2.12 as on 2.13.

torch 2.11 and 2.12's ``DefaultStager._stage`` ends with ``self._state_dict_stager.close()``
(pytorch#183413), which empties the StateDictStager's deepcopy dispatch table and its cache of
staged buffers: the stager's second ``stage()`` raises ``KeyError: <class 'type'>``. The installed
torch (2.13) no longer has that line; ``torch_2_11_stage`` puts it back, exactly as 2.11 has it,
so these tests run 2.11's staging path on CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from benchmarks.harness import dcp_failure, kept_stager

# TorchTitan's async_with_pinned_mem options as they apply on a CPU-only machine (pinning and
# non-blocking copies need an accelerator): shared memory, staging in a background thread.
CPU_PINNED_MODE = StagingOptions(False, True, True, False)


@pytest.fixture
def torch_2_11_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DefaultStager._stage`` as torch 2.11 and 2.12 have it: the 2.13 body, then the close."""
    stage_2_13 = DefaultStager._stage

    def stage_2_11(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        state_dict = stage_2_13(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return state_dict

    monkeypatch.setattr(DefaultStager, "_stage", stage_2_11)


def _state() -> dict[str, Any]:
    """A get_state_dict-like state: nested dicts, a param_groups list, a step, tensors."""
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.full((3, 4), 0.5)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w", "b"]}],
        },
        "step": 7,
    }


def _staged(stager: Any, state: dict[str, Any]) -> dict[str, Any]:
    out = stager.stage(state)
    return out.result(timeout=60) if hasattr(out, "result") else out


def test_the_2_11_stage_breaks_a_plain_default_stager_on_its_second_save(torch_2_11_stage: None) -> None:
    """The control: 2.11's stage, as reproduced here, fails as the H100 run did."""
    stager = DefaultStager(CPU_PINNED_MODE)
    try:
        _staged(stager, _state())
        with pytest.raises(KeyError) as err:
            _staged(stager, _state())
        assert err.value.args == (type,)
        assert "pytorch#183413" in dcp_failure(err.value)
    finally:
        stager.close()


@pytest.mark.parametrize("options", [CPU_PINNED_MODE, StagingOptions(False, False, False, False)])
def test_the_kept_stager_stages_every_save_and_reuses_its_buffers_under_2_11(
    torch_2_11_stage: None, options: StagingOptions
) -> None:
    state = _state()
    stager = kept_stager(options)
    try:
        first = _staged(stager, state)
        state["model"]["w"].add_(100.0)  # the training step between two saves
        state["optim"]["state"]["w"]["exp_avg"].mul_(2.0)
        second = _staged(stager, state)
        assert torch.equal(second["model"]["w"], state["model"]["w"])
        assert torch.equal(second["optim"]["state"]["w"]["exp_avg"], torch.full((3, 4), 1.0))
        assert second["step"] == 7 and second["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
        # DCP's design, as on 2.13: the second save is copied into the first one's buffers
        assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
        assert stager.closes_ignored == 2  # what the report says: this torch would have broken it
    finally:
        stager.release()
    assert len(stager._state_dict_stager._cached_storage_mapping) == 0  # released for real


def test_the_kept_stager_reports_no_workaround_where_torch_does_not_close_it() -> None:
    """On the installed torch, unpatched: no close to ignore from 2.13 on, so the report claims
    no workaround there."""
    stager = kept_stager(CPU_PINNED_MODE)
    try:
        _staged(stager, _state())
        _staged(stager, _state())
        closes = 2 if torch.torch_version.TorchVersion(torch.__version__) < (2, 13) else 0
        assert stager.closes_ignored == closes
    finally:
        stager.release()


def test_a_dcp_failure_says_its_cause_where_it_is_known() -> None:
    assert dcp_failure(RuntimeError("disk full")) == "RuntimeError: disk full"
    assert dcp_failure(KeyError("w")) == "KeyError: 'w'"
    text = dcp_failure(KeyError(type))
    assert text.startswith("KeyError: <class 'type'> (") and "pytorch#183413" in text

"""Megatron legacy tree -> torch_dist -> any layout / one consolidated file.

The legacy tree is built here the way Megatron-LM's ``save_checkpoint`` writes one
(``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` with ``args``, ``iteration``, local
TP shards, locally numbered layers and experts, RNG states), from known full tensors.
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptd
from ckptd.convert import SplitRule, consolidate, convert_legacy
from ckptd.errors import CheckpointExistsError, CheckpointNotFoundError, ShardingError, UnsafePickleError
from tests.cli import offline_cli

H, V, F, L, NE = 8, 12, 6, 4, 4  # hidden, vocab, ffn, layers, experts


def reference(experts: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    ref = {"embedding.word_embeddings.weight": r(V, H)}
    for i in range(L):
        p = f"decoder.layers.{i}."
        ref[p + "input_layernorm.weight"] = r(H)
        ref[p + "self_attention.linear_qkv.weight"] = r(3 * H, H)
        ref[p + "self_attention.linear_qkv.bias"] = r(3 * H)
        ref[p + "self_attention.linear_proj.weight"] = r(H, H)
        ref[p + "self_attention.linear_proj.bias"] = r(H)
        ref[p + "mlp.linear_fc1.weight"] = r(2 * F, H)  # SwiGLU: [gate; up]
        ref[p + "mlp.linear_fc2.weight"] = r(H, F)
        if experts:
            for e in range(NE):
                ref[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = r(2 * F, H)
                ref[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = r(H, F)
    ref["decoder.final_layernorm.weight"] = r(H)
    ref["output_layer.weight"] = r(V, H)
    return ref


def _tp_shard(key: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if tp == 1:
        return t.clone()
    if key.endswith("linear_fc1.weight"):
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]]).clone()
    axis = None
    if "layer_norm_" in key:  # a layernorm fused into a TE linear: replicated
        pass
    elif any(s in key for s in ("word_embeddings", "output_layer", "linear_qkv", "linear_fc1")):
        axis = 0
    elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        axis = 1
    return t.clone() if axis is None else t.chunk(tp, axis)[rank].clone()


def write_legacy_tree(
    root: Path, ref: dict[str, torch.Tensor], tp: int, pp: int, ep: int, numpy_rng: bool = True
) -> Path:
    """Write ``ref`` as Megatron-LM's legacy ``torch`` format would at TP x PP x EP."""
    it = root / "iter_0000100"
    per_stage = L // pp
    per_ep = NE // ep
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                model: dict[str, object] = {}
                for key, full in ref.items():
                    if key.startswith("embedding.") and p != 0:
                        continue
                    if key.startswith(("decoder.final_layernorm", "output_layer")) and p != pp - 1:
                        continue
                    local_key = key
                    if ".layers." in key:
                        layer = int(key.split(".")[2])
                        if layer // per_stage != p:
                            continue
                        local_key = key.replace(f"layers.{layer}.", f"layers.{layer % per_stage}.", 1)
                        if ".local_experts." in key:
                            expert = int(key.split("local_experts.")[1].split(".")[0])
                            if expert // per_ep != e:
                                continue
                            local_key = local_key.replace(
                                f"local_experts.{expert}.", f"local_experts.{expert % per_ep}."
                            )
                    model[local_key] = _tp_shard(key, full, tp, t)
                for j in range(per_stage):  # TE's, in every layer (a stacked object needs all its shards)
                    model[f"decoder.layers.{j}.self_attention.core_attention._extra_state"] = io.BytesIO(b"te")
                rng = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}
                if numpy_rng:
                    rng["np_rng_state"] = np.random.get_state()
                sd = {
                    "args": argparse.Namespace(
                        tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp,
                        expert_model_parallel_size=ep,
                        num_layers=L,
                        swiglu=True,
                        lr=1e-3,
                    ),
                    "checkpoint_version": 3.0,
                    "iteration": 100,
                    "model": model,
                    "optimizer": {
                        "state": {0: {"exp_avg": torch.zeros(3)}},
                        "param_groups": [{"lr": 1e-3, "params": [0]}],
                    },
                    "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 100},
                    "rng_state": [rng],
                    "num_floating_point_operations_so_far": 1.5e15,
                    "rerun_state_machine_state": {"mode": "disabled", "rank": t},
                }
                name = f"mp_rank_{t:02d}"
                if pp > 1:
                    name += f"_{p:03d}"
                if ep > 1:
                    name += f"_{e:03d}"
                (it / name).mkdir(parents=True)
                torch.save(sd, it / name / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    return it


def test_legacy_tp2_pp2_converts_and_reshards(tmp_path):
    ref = reference(experts=False)
    write_legacy_tree(tmp_path / "legacy", ref, tp=2, pp=2, ep=1)
    with pytest.raises(UnsafePickleError, match="allow_unsafe_pickle"):
        convert_legacy(tmp_path / "legacy", tmp_path / "dist0", fsync=False)
    seen: list[tuple[int, int, str]] = []
    report = convert_legacy(
        tmp_path / "legacy",
        tmp_path / "dist",
        allow_unsafe_pickle=True,
        progress=lambda d, t, label: seen.append((d, t, label)),
        fsync=False,
    )
    assert report.tensors == len(ref) and report.iteration == 100
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] > 0 and len(seen) == 3
    assert any("_extra_state" in k for k in report.skipped)

    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    assert sorted(plain) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(plain[k], v), k
    common = ckptd.load_common_state_dict(tmp_path / "dist")
    assert common["iteration"] == 100 and common["args"]["tensor_model_parallel_size"] == 2
    assert common["converted_from"] == {"format": "megatron-legacy", "tp": 2, "pp": 2, "ep": 1}
    # Megatron-LM's FLOP count goes along (it restarted from 0); what is dropped is named.
    assert common["num_floating_point_operations_so_far"] == 1.5e15
    assert report.dropped == ["optimizer", "rerun_state_machine_state", "rng_state"]

    # Load at TP=4 (four ranks' requests in one process): columns and rows split differently.
    for rank in range(4):
        req = {
            "qkv": ckptd.ShardedTensor.from_rank_offsets(
                "decoder.layers.3.self_attention.linear_qkv.weight", torch.empty(3 * H // 4, H), (0, rank, 4)
            ),
            "proj": ckptd.ShardedTensor.from_rank_offsets(
                "decoder.layers.2.self_attention.linear_proj.weight", torch.empty(H, H // 4), (1, rank, 4)
            ),
        }
        out = ckptd.load(req, tmp_path / "dist")
        assert torch.equal(out["qkv"], ref["decoder.layers.3.self_attention.linear_qkv.weight"].chunk(4, 0)[rank])
        assert torch.equal(out["proj"], ref["decoder.layers.2.self_attention.linear_proj.weight"].chunk(4, 1)[rank])

    consolidate(tmp_path / "dist", tmp_path / "model.pt", fsync=False)
    whole = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(whole) == sorted(ref) and all(torch.equal(whole[k], ref[k]) for k in ref)
    with pytest.raises(CheckpointExistsError):
        convert_legacy(tmp_path / "legacy", tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)


def test_legacy_experts_and_stacked_layers(tmp_path):
    ref = reference(experts=True)
    it = write_legacy_tree(tmp_path / "legacy", ref, tp=2, pp=1, ep=2, numpy_rng=False)
    assert (it / "mp_rank_01_001").is_dir()  # two numbers: TP + EP (args say PP=1, EP=2)
    convert_legacy(it, tmp_path / "dist", stack_layers=True, fsync=False)  # safe: no numpy inside
    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    stacked = plain["decoder.layers.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert stacked.shape == (L, H, F)
    for i in range(L):
        assert torch.equal(stacked[i], ref[f"decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc2.weight"])
        assert torch.equal(
            plain["decoder.layers.mlp.linear_fc1.weight"][i], ref[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        )
    assert torch.equal(plain["output_layer.weight"], ref["output_layer.weight"])


def test_legacy_bad_inputs(tmp_path):
    ref = reference(experts=False)
    ref["decoder.layers.0.extra.weight"] = torch.randn(4, 4)  # split on TP, but no rule knows it
    it = write_legacy_tree(tmp_path / "legacy", ref, tp=1, pp=1, ep=1, numpy_rng=False)
    # TP=1 converts without rules; now fake a TP=2 tree whose unknown tensor differs per rank.
    tp2 = tmp_path / "tp2" / "iter_0000100"
    for t in range(2):
        sd = torch.load(it / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        sd["model"] = {"decoder.layers.0.extra.weight": torch.full((2, 4), float(t))}
        (tp2 / f"mp_rank_{t:02d}").mkdir(parents=True)
        torch.save(sd, tp2 / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    with pytest.raises(ShardingError, match=r"extra\.weight.*no split rule"):
        convert_legacy(tp2, tmp_path / "out1", fsync=False)
    with pytest.raises(ShardingError, match=r"'\[=0' is not a regular expression"):  # was a traceback, late
        SplitRule.parse("[=0=0")
    convert_legacy(tp2, tmp_path / "out2", rules=[SplitRule.parse(r"extra\.weight$=0")], fsync=False)
    assert torch.equal(
        ckptd.load_plain_tensors(tmp_path / "out2")["decoder.layers.0.extra.weight"],
        torch.cat([torch.zeros(2, 4), torch.ones(2, 4)]),
    )
    (tp2 / "mp_rank_01" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no model_optim_rng.pt"):
        convert_legacy(tp2, tmp_path / "out3", fsync=False)
    # A tracker that is no ASCII number ("²" passes str.isdigit(), then int() raised ValueError).
    tracker = tmp_path / "legacy" / "latest_checkpointed_iteration.txt"
    for text in ("²", "\xff"):
        tracker.write_bytes(text.encode("utf-8") if text == "²" else b"\xff")
        with pytest.raises(CheckpointNotFoundError, match="latest_checkpointed_iteration.txt"):
            convert_legacy(tmp_path / "legacy", tmp_path / "out4", fsync=False)
    with pytest.raises(CheckpointNotFoundError, match="no mp_rank"):
        convert_legacy(tmp_path, tmp_path / "out4", fsync=False)


def test_mcore_spec_names_keys_and_writes_extra_states_as_megatron_core_asks(tmp_path):
    """The TE spec's names stay, stacked over a TP=2 x PP=2 tree; the local spec's layernorms get
    the TE names; each `_extra_state` (TP rank 0's) is the ShardedObject GPTModel asks for."""
    local = reference(experts=False)
    fused = "self_attention.linear_qkv.layer_norm_weight"
    te = {k.replace("input_layernorm.weight", fused): v for k, v in local.items()}
    write_legacy_tree(tmp_path / "te", te, tp=2, pp=2, ep=1, numpy_rng=False)
    report = convert_legacy(tmp_path / "te", tmp_path / "te-dist", stack_layers=True, mcore_spec="auto", fsync=False)
    assert report.objects == L and report.tensors == len(te)  # one extra state per layer
    plain = ckptd.load_plain_tensors(tmp_path / "te-dist")
    for i in range(L):
        assert torch.equal(
            plain["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
            te[f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"],
        )
    # The tree writes an extra state in every layer: one stacked object of L shards.
    key = "decoder.layers.self_attention.core_attention._extra_state"
    req = {f"x{i}": ckptd.ShardedObject(key, None, (L,), (i,)) for i in range(L)}
    out = ckptd.load(req, tmp_path / "te-dist", allow_unsafe_pickle=True)  # TE's BytesIO
    assert [out[f"x{i}"].getvalue() for i in range(L)] == [b"te"] * L

    write_legacy_tree(tmp_path / "local", local, tp=1, pp=2, ep=1, numpy_rng=False)
    report = convert_legacy(tmp_path / "local", tmp_path / "local-dist", mcore_spec="local", fsync=False)
    plain = ckptd.load_plain_tensors(tmp_path / "local-dist")
    assert not any("input_layernorm" in k for k in plain)
    assert torch.equal(
        plain["decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"],
        local["decoder.layers.3.input_layernorm.weight"],
    )
    req = {"x": ckptd.ShardedObject("decoder.layers.2.self_attention.core_attention._extra_state", None, (1,), (0,))}
    assert ckptd.load(req, tmp_path / "local-dist", allow_unsafe_pickle=True)["x"].getvalue() == b"te"
    # Without mcore_spec, the legacy names stay and extra states are skipped.
    report = convert_legacy(tmp_path / "local", tmp_path / "plain-dist", fsync=False)
    assert report.objects == 0 and report.skipped
    assert "decoder.layers.3.input_layernorm.weight" in ckptd.load_plain_tensors(tmp_path / "plain-dist")


def test_mcore_spec_refuses_what_it_cannot_name(tmp_path):
    experts = write_legacy_tree(tmp_path / "moe", reference(experts=True), tp=1, pp=1, ep=1, numpy_rng=False)
    with pytest.raises(ShardingError, match=r"local_experts.*MoE expert.*without --mcore-spec"):
        convert_legacy(experts, tmp_path / "o1", mcore_spec="local", fsync=False)
    old_names = {"language_model.embedding.word_embeddings.weight": torch.ones(V, H)}
    legacy = write_legacy_tree(tmp_path / "lm", old_names, tp=1, pp=1, ep=1, numpy_rng=False)
    with pytest.raises(ShardingError, match=r"language_model.*pre-Megatron-Core"):
        convert_legacy(legacy, tmp_path / "o2", mcore_spec="auto", fsync=False)
    no_norms = {k: v for k, v in reference(experts=False).items() if "layernorm" not in k}
    ambiguous = write_legacy_tree(tmp_path / "nn", no_norms, tp=1, pp=1, ep=1, numpy_rng=False)
    with pytest.raises(ShardingError, match=r"model_optim_rng.pt: cannot tell.*neither.*--mcore-spec"):
        convert_legacy(ambiguous, tmp_path / "o3", mcore_spec="auto", fsync=False)
    with pytest.raises(ShardingError, match="'local', 'te', 'auto'"):
        convert_legacy(ambiguous, tmp_path / "o4", mcore_spec="transformer-engine", fsync=False)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))  # refused before writing


@pytest.mark.timeout(120)
def test_cli_is_quiet_off_tty(tmp_path):
    """``ckptd convert`` end to end, as a process whose stderr is not a terminal: no progress bar."""
    ref = reference(experts=False)
    write_legacy_tree(tmp_path / "legacy", ref, tp=2, pp=1, ep=1, numpy_rng=False)
    run = offline_cli("convert", "to-dist", tmp_path / "legacy", tmp_path / "dist", "--no-fsync", timeout_s=100)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "" and f"converted {len(ref)} tensors" in run.stdout
    run = offline_cli("convert", "to-dist", tmp_path / "legacy", tmp_path / "dist", timeout_s=100)
    assert run.returncode == 1 and "already holds a checkpoint" in run.stderr


def test_progress_draws_only_on_tty(tmp_path):
    from ckptd.commands.convert import ConvertProgress

    class Stream(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    write_legacy_tree(tmp_path / "legacy", reference(experts=False), tp=1, pp=2, ep=1, numpy_rng=False)
    for tty in (True, False):
        s = Stream(tty)
        bar = ConvertProgress(s)
        convert_legacy(tmp_path / "legacy", tmp_path / f"dist{tty}", progress=bar, fsync=False)
        bar.close()
        text = s.getvalue()
        if tty:
            assert "\r" in text and "100%" in text and "mp_rank_00_001" in text and text.endswith("\n")
        else:
            assert text == ""


def test_a_swiglu_dense_h_to_4h_of_legacy_names_is_stored_as_gate_then_up(tmp_path):
    """Megatron-LM's own names (``language_model.encoder.layers.N.mlp.dense_h_to_4h``) hold
    ``[gate_r; up_r]`` per TP rank under SwiGLU, as ``linear_fc1`` does: they were stacked rank by
    rank, ``[g_0; u_0; g_1; u_1]``, so a load at another TP size or the consolidated file had gate
    and up rows interleaved, silently."""
    g = torch.Generator().manual_seed(3)
    fc1, fc2 = torch.randn(2 * F, H, generator=g), torch.randn(H, F, generator=g)
    gate, up = fc1.chunk(2, 0)
    it = tmp_path / "legacy" / "iter_0000100"
    for t in range(2):
        model = {
            "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight": torch.cat(
                [gate.chunk(2, 0)[t], up.chunk(2, 0)[t]]
            ).clone(),
            "language_model.encoder.layers.0.mlp.dense_4h_to_h.weight": fc2.chunk(2, 1)[t].clone(),
        }
        args = argparse.Namespace(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_layers=1, swiglu=True
        )
        (it / f"mp_rank_{t:02d}").mkdir(parents=True)
        torch.save({"args": args, "iteration": 100, "model": model}, it / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("100")
    convert_legacy(tmp_path / "legacy", tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)
    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    (fc1_key,) = [k for k in plain if k.endswith("dense_h_to_4h.weight")]
    (fc2_key,) = [k for k in plain if k.endswith("dense_4h_to_h.weight")]
    assert torch.equal(plain[fc1_key], fc1) and torch.equal(plain[fc2_key], fc2)


def test_to_dist_refuses_an_output_inside_the_legacy_checkpoint(tmp_path):
    """Written into the iteration directory next to its mp_rank_* directories, the output made the
    legacy checkpoint look like a torch_dist one."""
    from ckptd.errors import OutputInsideCheckpointError

    write_legacy_tree(tmp_path / "legacy", reference(experts=False), tp=2, pp=1, ep=1)
    (tmp_path / "link").symlink_to(tmp_path / "legacy")
    for dst in (tmp_path / "legacy" / "iter_0000100", tmp_path / "legacy", tmp_path / "link" / "iter_0000100" / "out"):
        with pytest.raises(OutputInsideCheckpointError, match="inside the legacy checkpoint"):
            convert_legacy(tmp_path / "legacy", dst, allow_unsafe_pickle=True, fsync=False)
    assert sorted(p.name for p in (tmp_path / "legacy" / "iter_0000100").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    convert_legacy(tmp_path / "legacy", tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)


def test_a_tensor_only_another_tp_rank_holds_is_never_dropped(tmp_path):
    """The conversion writes TP rank 0's keys: a tensor that only TP rank 1's file held was left
    out of the checkpoint, silently."""
    it = write_legacy_tree(tmp_path / "legacy", reference(experts=False), tp=2, pp=1, ep=1, numpy_rng=False)
    path = it / "mp_rank_01" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)
    sd["model"]["decoder.layers.0.only_on_rank_1.weight"] = torch.ones(2)
    torch.save(sd, path)
    with pytest.raises(ShardingError, match=r"mp_rank_01.* lacks: \['decoder.layers.0.only_on_rank_1.weight'\]"):
        convert_legacy(tmp_path / "legacy", tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)


def _write_ranks(it: Path, models: dict[str, dict[str, torch.Tensor]], **args: object) -> Path:
    """One ``model_optim_rng.pt`` per rank directory name, with ``args``."""
    for name, model in models.items():
        (it / name).mkdir(parents=True)
        torch.save(
            {"args": argparse.Namespace(**args), "iteration": 10, "model": model}, it / name / "model_optim_rng.pt"
        )
    return it


@pytest.mark.parametrize("swiglu", [True, False])
def test_each_mlp_is_split_as_its_width_says_gated_or_not(tmp_path, swiglu):
    """A SwiGLU language model's fc1 next to a GELU vision tower's (LLaVA), both ``linear_fc1``: the
    args' one setting interleaved gate and up rows of one of them at TP 2, silently (and of every
    fc1 when the args did not say ``swiglu``)."""
    g = torch.Generator().manual_seed(5)
    ref = {
        "vision_model.decoder.layers.0.mlp.linear_fc1.weight": torch.randn(F, H, generator=g),
        "vision_model.decoder.layers.0.mlp.linear_fc1.bias": torch.randn(F, generator=g),
        "vision_model.decoder.layers.0.mlp.linear_fc2.weight": torch.randn(H, F, generator=g),
        "language_model.decoder.layers.0.mlp.linear_fc1.weight": torch.randn(2 * F, H, generator=g),
        "language_model.decoder.layers.0.mlp.linear_fc2.weight": torch.randn(H, F, generator=g),
    }

    def shard(key: str, t: torch.Tensor, r: int) -> torch.Tensor:
        if key.startswith("language") and "fc1" in key:
            gate, up = t.chunk(2, 0)
            return torch.cat([gate.chunk(2, 0)[r], up.chunk(2, 0)[r]]).clone()
        return t.chunk(2, 0 if "fc1" in key else 1)[r].clone()

    models = {f"mp_rank_{r:02d}": {k: shard(k, v, r) for k, v in ref.items()} for r in range(2)}
    it = _write_ranks(tmp_path / "legacy" / "iter_0000010", models, tensor_model_parallel_size=2, swiglu=swiglu)
    convert_legacy(it, tmp_path / "dist", fsync=False)
    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    assert {k: torch.equal(plain[k], v) for k, v in ref.items()} == dict.fromkeys(ref, True)
    # A user's rule that contradicts the width is refused, naming the tensor.
    with pytest.raises(ShardingError, match=r"'vision_model.*linear_fc1.weight' is not a gated linear unit"):
        convert_legacy(it, tmp_path / "dist2", rules=[SplitRule(r"vision_model.*linear_fc1\.weight$", 0, glu=True)])


@pytest.mark.parametrize("stack", [False, True])
def test_each_layer_stack_is_numbered_on_its_own_across_pipeline_stages(tmp_path, stack):
    """A stage holding two layer stacks (a vision tower and a language model's layers; a
    multi-token prediction block next to the decoder's last layers) offset every stack by the
    largest: language layers 2-3 of stage 1 became 4-5, ``mtp.layers.0`` became 2."""

    def t(v: float) -> torch.Tensor:
        return torch.full((H,), float(v))

    stages = [
        {
            **{f"vision_model.decoder.layers.{i}.input_layernorm.weight": t(50 + i) for i in range(4)},
            **{f"decoder.layers.{i}.input_layernorm.weight": t(i) for i in range(2)},
        },
        {
            **{f"decoder.layers.{i}.input_layernorm.weight": t(2 + i) for i in range(2)},
            "mtp.layers.0.enorm.weight": t(9),
        },
    ]
    models = {f"mp_rank_00_{p:03d}": model for p, model in enumerate(stages)}
    it = _write_ranks(tmp_path / "legacy" / "iter_0000010", models, pipeline_model_parallel_size=2)
    convert_legacy(it, tmp_path / "dist", fsync=False, stack_layers=stack)
    plain = ckptd.load_plain_tensors(tmp_path / "dist")
    expected = {
        **{f"vision_model.decoder.layers.{i}.input_layernorm.weight": t(50 + i) for i in range(4)},
        **{f"decoder.layers.{i}.input_layernorm.weight": t(i) for i in range(4)},
        "mtp.layers.0.enorm.weight": t(9),
    }
    if stack:  # one tensor per stack, with its own number of layers; MTP's never stacked (Megatron-Core)
        expected = {
            "vision_model.decoder.layers.input_layernorm.weight": torch.stack([t(50 + i) for i in range(4)]),
            "decoder.layers.input_layernorm.weight": torch.stack([t(i) for i in range(4)]),
            "mtp.layers.0.enorm.weight": t(9),
        }
    assert sorted(plain) == sorted(expected)
    assert all(torch.equal(plain[k], v) for k, v in expected.items())


@pytest.mark.parametrize("uneven", ["lacking", "shapes"])
def test_stacking_layers_that_differ_is_refused_before_anything_is_written(tmp_path, uneven):
    """MoE layers after dense first layers (a router only some layers hold), or feed-forward widths
    that vary by layer: every data file was written, then the checkpoint failed to finalize with an
    error about replicas or global shapes that did not say the layers differ."""
    g = torch.Generator().manual_seed(3)

    def layer(i: int, local: int) -> dict[str, torch.Tensor]:
        ffn = 2 * F if uneven == "shapes" and i == 3 else F
        out = {f"decoder.layers.{local}.mlp.linear_fc2.weight": torch.randn(H, ffn, generator=g)}
        if uneven == "lacking" and i >= 2:
            out[f"decoder.layers.{local}.mlp.router.weight"] = torch.randn(NE, H, generator=g)
        return out

    # Two pipeline stages of two layers each: stage 1's local layers 0-1 are global layers 2-3.
    models = {f"mp_rank_00_{p:03d}": {**layer(2 * p, 0), **layer(2 * p + 1, 1)} for p in (0, 1)}
    it = _write_ranks(tmp_path / "legacy" / "iter_0000010", models, pipeline_model_parallel_size=2)
    labels: list[str] = []
    expected = {
        "lacking": r"'decoder.layers.mlp.router.weight' cannot be stacked over the 4 layers of "
        r"'decoder.layers'.*: layers 0-1 lack it",
        "shapes": r"'decoder.layers.mlp.linear_fc2.weight' cannot be stacked .*: its layers differ in dtype or "
        rf"shape: torch.float32 \({H}, {F}\) in layers 0-2; torch.float32 \({H}, {2 * F}\) in layer 3",
    }[uneven]
    with pytest.raises(ShardingError, match=expected + r".*Convert without --stack-layers"):
        convert_legacy(it, tmp_path / "dist", stack_layers=True, progress=lambda *a: labels.append(a[2]), fsync=False)
    assert labels == ["start"]  # refused before the first stage was written
    assert not (tmp_path / "dist").exists()
    # Layer by layer, it converts.
    convert_legacy(it, tmp_path / "dist", fsync=False)
    assert len(ckptd.load_plain_tensors(tmp_path / "dist")) == (6 if uneven == "lacking" else 4)


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_embedding_held_by_two_stages_is_compared(tmp_path, caplog, same):
    """The last stage's copy of a tied embedding was dropped after a check of its shape only."""
    emb = torch.arange(12.0).reshape(3, 4)
    stages = [
        {"embedding.word_embeddings.weight": emb, "decoder.layers.0.input_layernorm.weight": torch.ones(4)},
        {
            "embedding.word_embeddings.weight": emb if same else emb + 1,
            "decoder.layers.0.input_layernorm.weight": torch.ones(4),
        },
    ]
    models = {f"mp_rank_00_{p:03d}": model for p, model in enumerate(stages)}
    it = _write_ranks(tmp_path / "legacy" / "iter_0000010", models, pipeline_model_parallel_size=2)
    with caplog.at_level("INFO", logger="ckptd.convert"):
        convert_legacy(it, tmp_path / "dist", fsync=False)
    assert torch.equal(ckptd.load_plain_tensors(tmp_path / "dist")["embedding.word_embeddings.weight"], emb)
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "different values" in r.getMessage()]
    assert len(warned) == (0 if same else 1)


def test_an_fc1_of_neither_width_needs_a_rule_and_follows_one(tmp_path):
    fc1, fc2 = torch.randn(3 * F, H), torch.randn(H, F)
    models = {
        f"mp_rank_{r:02d}": {
            "decoder.layers.0.mlp.linear_fc1.weight": fc1.chunk(2, 0)[r].clone(),
            "decoder.layers.0.mlp.linear_fc2.weight": fc2.chunk(2, 1)[r].clone(),
        }
        for r in range(2)
    }
    it = _write_ranks(tmp_path / "legacy" / "iter_0000010", models, tensor_model_parallel_size=2)
    with pytest.raises(ShardingError, match=r"'decoder.layers.0.mlp.linear_fc1.weight' is an MLP's fc1 whose width"):
        convert_legacy(it, tmp_path / "dist", fsync=False)
    convert_legacy(it, tmp_path / "dist", rules=[SplitRule.parse(r"linear_fc1\.weight$=0")], fsync=False)
    assert torch.equal(ckptd.load_plain_tensors(tmp_path / "dist")["decoder.layers.0.mlp.linear_fc1.weight"], fc1)


def test_the_files_a_conversion_does_not_read_are_named(tmp_path):
    """A distributed optimizer's distrib_optim.pt (the Adam moments) was left behind unsaid: the
    report named only the rank files' top-level entries, whose "optimizer" is its param groups."""
    it = write_legacy_tree(tmp_path / "legacy", reference(experts=False), tp=2, pp=1, ep=1)
    for rank_dir in it.iterdir():
        (rank_dir / "distrib_optim.pt").write_bytes(b"moments")
    report = convert_legacy(tmp_path / "legacy", tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)
    assert "distrib_optim.pt (files of the rank directories)" in report.dropped


@pytest.mark.parametrize("tp, version", [(2, 1.0), (1, 0), (2, None), (1, np.float64(1.0))])
def test_a_per_rank_qkv_head_order_is_refused(tmp_path, tp, version):
    """checkpoint_version < 2.0 (a missing one is 0) holds each rank's fused query/key/value heads
    in a per-rank order Megatron-LM fixes after loading by the heads per partition of the loading
    layout: joined across ranks, or loaded at another TP, the tensor was silently wrong."""
    qkv = torch.randn(12, H)
    it = tmp_path / "legacy" / "iter_0000010"
    for t in range(tp):
        (it / f"mp_rank_{t:02d}").mkdir(parents=True)
        sd = {
            "args": argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1),
            "iteration": 10,
            "model": {"language_model.encoder.layers.0.self_attention.query_key_value.weight": qkv.chunk(tp)[t]},
        }
        if version is not None:
            sd["checkpoint_version"] = version
        torch.save(sd, it / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    with pytest.raises(
        ShardingError,
        match=rf"query_key_value.weight' is in the query/key/value head order of checkpoint_version {version or 0}",
    ):
        convert_legacy(it, tmp_path / "dist", allow_unsafe_pickle=True, fsync=False)
    assert not (tmp_path / "dist").exists()


def test_mcore_spec_names_the_norms_of_a_multi_token_prediction_layer_as_its_transformer_layer_does():
    """An MTP layer's transformer layer renames its norms under its own prefix (Megatron-Core's
    TransformerLayer.sharded_state_dict, called with ``mtp.layers.N.transformer_layer.``): they
    kept their names, the conversion said nothing, and the load found no such keys."""
    from ckptd.convert.mcore import key_map, mcore_key

    local = key_map("local", [])
    assert (
        mcore_key(local, "mtp.layers.0.transformer_layer.input_layernorm.weight")
        == "mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight"
    )
    assert (
        mcore_key(local, "mtp.layers.1.transformer_layer.pre_mlp_layernorm.bias")
        == "mtp.layers.1.transformer_layer.mlp.linear_fc1.layer_norm_bias"
    )
    assert mcore_key(local, "mtp.layers.0.enorm.weight") == "mtp.layers.0.enorm.weight"  # the MTP layer's own
    assert (
        mcore_key(local, "decoder.layers.2.input_layernorm.weight")
        == "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    )

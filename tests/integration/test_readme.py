"""The README's example runs as printed: the first run saves, the second resumes from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.format.rootlayout import step_dir_name
from tests.multiproc import without_torchrun

REPO = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Example") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(180)
def test_readme_example_saves_then_resumes(tmp_path, runtime_dir):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 22
    env = {**without_torchrun(os.environ), "CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "1"}
    outs = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(run.stdout)
    assert "latest committed step: 15" in outs[0]
    assert "latest committed step: 35" in outs[1]  # resumed at 16, saved 20..35
    assert sorted(p.name for p in (tmp_path / "ckpts" / "run1").glob("iter_*")) == [
        step_dir_name(s) for s in (0, 5, 10, 15, 20, 25, 30, 35)
    ]
    subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "daemon", "stop", "--root", str(tmp_path / "ckpts" / "run1")],
        env=env,
        timeout=60,
        check=True,
        capture_output=True,
    )


def readme_blocks(heading: str) -> list[str]:
    """The python code blocks of the README section under ``heading`` (up to the next heading)."""
    text = (REPO / "README.md").read_text()
    start = text.index(heading)
    end = text.find("\n##", start + len(heading))
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)


def _fsdp2_blocks_resume_exactly(rank: int, world: int, root: str) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptd

    (code,) = readme_blocks("### Using it from FSDP2 / DCP code")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def trainer(model, optimizer):
        def train_step(step):
            gen = torch.Generator().manual_seed(step * 10 + rank)
            loss = model(torch.randn(4, 6, generator=gen)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return train_step

    model, optimizer = build()  # the uninterrupted reference: steps 1..4
    for step in range(1, 5):
        trainer(model, optimizer)(step)
    reference = [p.full_tensor().clone() for p in model.parameters()]
    closed = []
    for _ in range(2):  # the README's lines, twice: steps 1-2 and save; then resume, steps 3-4
        model, optimizer = build()
        scope = {
            "ckptd": ckptd,
            "model": model,
            "optimizer": optimizer,
            "ckpt_root": root,
            "train_step": trainer(model, optimizer),
        }
        exec(code, scope)
        closed.append(scope["ckpt"]._closed)  # the README's lines close what they open
        dist.barrier()
    params = [p.full_tensor() for p in model.parameters()]
    problems = [] if all(torch.equal(a, b) for a, b in zip(params, reference)) else ["not bit-exact"]
    return problems + ([] if closed == [True, True] else ["the Checkpointer was left open"])


@pytest.mark.timeout(240)
def test_readme_fsdp2_lines_resume_bit_exact(tmp_path, runtime_dir):
    from tools.harness.ranks import run_ranks

    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "1"}
    assert run_ranks(_fsdp2_blocks_resume_exactly, 2, str(tmp_path / "run"), timeout_s=200, env=env) == [[], []]
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == [step_dir_name(s) for s in (1, 2, 3, 4)]


def _megatron_blocks_round_trip(rank: int, world: int, root: str) -> list[str]:
    import torch

    import ckptd
    from tests.real.megatron_gpt import adamw, build_gpt, sharded_state, train_a_little

    save_code, load_code, close_code = readme_blocks("### Using it from Megatron-Core / Megatron-LM")
    model = build_gpt(tp=world)
    optimizer = adamw(model)
    train_a_little(model, optimizer, seed=0)  # replicated parameters stay equal across TP ranks, as in training
    saved = [p.detach().clone() for p in model.parameters()]
    content = {"distrib_optim_sharding_type": "dp_reshardable"}
    scope = {
        "ckptd": ckptd,
        "save_dir": root,
        "iteration": 12,
        "state_dict": sharded_state(model, optimizer, iteration=12),
        "sharded_sd_metadata": content,
    }
    exec(save_code, scope)
    scope["handle"].wait(timeout_s=120)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    scope["state_dict"] = sharded_state(model, optimizer, iteration=0)
    scope["sharded_sd_metadata"] = None
    exec(load_code, scope)
    exec(close_code, scope)
    if not scope["ckpt"]._closed:
        return ["the README's lines leave the Checkpointer open"]
    ok = scope["iteration"] == 12 and all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))
    ok = ok and scope["sharded_sd_metadata"] == content
    return [] if ok else [f"iteration {scope['iteration']}, content {scope['sharded_sd_metadata']}, restored: {ok}"]


@pytest.mark.timeout(240)
def test_readme_megatron_lines_save_and_load(tmp_path, runtime_dir):
    from tools.harness.ranks import run_ranks

    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "1"}
    assert run_ranks(_megatron_blocks_round_trip, 2, str(tmp_path / "run"), timeout_s=200, daemon=False, env=env) == [
        [],
        [],
    ]


def _torchtitan_blocks_resume_exactly(rank: int, world: int, root: str) -> list[str]:
    """The README's TorchTitan lines on Stateful objects over an FSDP2 model, twice (steps 1-2,
    then resumed: 3-4), against an uninterrupted run: model, optimizer, train state and each
    rank's dataloader position."""
    import torch
    import torch.distributed as dist

    import ckptd
    from tests.integration import titan

    (code,) = readme_blocks("### Using it from TorchTitan")

    def job() -> dict:
        model, optimizer = titan.build(0, world)
        train_state, dataloader = titan.TrainState(), titan.Dataloader(rank, world)

        def train_step(step: int) -> None:
            titan.train_step(model, optimizer, step)
            dataloader.next_batch()
            train_state.step = step
            train_state.ntokens_seen += 4

        return {
            "ckptd": ckptd,
            "ckpt_root": root,
            "model_wrapper": titan.ModelWrapper(model),
            "optimizers": titan.OptimizersContainer(model, optimizer),
            "train_state": train_state,
            "dataloader": dataloader,
            "train_step": train_step,
        }

    reference = job()
    for step in range(1, 5):
        reference["train_step"](step)
    problems = []
    for run in range(2):
        scope = job()
        exec(code, scope)
        if not scope["ckpt"]._closed:
            problems.append("the README's lines leave the Checkpointer open")
        dist.barrier()
        if run == 1 and scope["train_state"].loaded != 1:
            problems.append("the second run did not resume")
    got = (scope["train_state"].state_dict(), scope["dataloader"].position)
    want = (reference["train_state"].state_dict(), reference["dataloader"].position)
    if got != want:
        problems.append(f"train state and dataloader position {got}, uninterrupted {want}")
    params = titan.full_params(scope["model_wrapper"].model)
    if not all(torch.equal(a, b) for a, b in zip(params, titan.full_params(reference["model_wrapper"].model))):
        problems.append("the model is not bit-exact")
    return problems


@pytest.mark.timeout(300)
def test_readme_torchtitan_lines_resume_bit_exact(tmp_path, runtime_dir):
    from tools.harness.ranks import run_ranks

    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "1"}
    assert run_ranks(_torchtitan_blocks_resume_exactly, 2, str(tmp_path / "run"), timeout_s=260, env=env) == [[], []]
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == [step_dir_name(s) for s in (1, 2, 3, 4)]


def _table(heading: str, first_header: str) -> list[list[str]]:
    """Cells of the rows of the table whose first column is ``first_header``, below ``heading``."""
    text = (REPO / "README.md").read_text()
    text = text[text.index(heading) :]
    text = text[text.index(f"| {first_header} |") :]
    rows = []
    for line in text.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def _default_text(value: object) -> str | None:
    """How the README writes a default, for the defaults that are plain values."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if value < 1 << 20 else f"{value / 2**20:g} MiB"
    return None


def test_the_configuration_table_lists_every_field_with_its_default():
    from dataclasses import MISSING, fields

    from ckptd.config import CkptdConfig

    documented: dict[str, str] = {}
    for cells in _table("## Configuration", "field"):
        names = re.findall(r"`(\w+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(" / ")] if len(names) > 1 else [cells[1]]
        documented.update(zip(names, defaults if len(defaults) == len(names) else [cells[1]] * len(names)))
    for f in fields(CkptdConfig):
        assert f.name in documented, f"the README's configuration table lacks {f.name}"
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        text = documented[f.name]
        # Where the README writes a value (not how an empty default is derived), it is the code's.
        if f.metadata.get("octal"):
            assert text == f"`{default:#o}`", (f.name, text)
        elif re.fullmatch(r"[0-9.]+( MiB)?|true|false", text):
            assert text == _default_text(default), (f.name, text, default)
        elif re.fullmatch(r"`[^`]*`", text):
            assert text.strip("`").strip('"') == default, (f.name, text, default)


def _params(fn: object, positional_names: bool = True) -> list[tuple[str, object]]:
    import inspect

    out: list[tuple[str, object]] = []
    for p in inspect.signature(fn).parameters.values():  # type: ignore[arg-type]
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and ("*", None) not in out:
            out.append(("*", None))
        name = f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name
        out.append((name if positional_names or p.kind is p.KEYWORD_ONLY else "_", p.default))
    return out


def _documented_params(text: str, positional_names: bool = True) -> list[tuple[str, object]]:
    import inspect

    import ckptd

    out: list[tuple[str, object]] = []
    star = False
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, default = part.partition("=")
        star = star or name == "*"
        if not positional_names and not star and not name.startswith("**"):
            name = "_"
        names = {n: getattr(ckptd, n) for n in dir(ckptd)}  # ckptd's names are imported lazily
        value = eval(default, names) if default else (None if name == "*" else inspect.Parameter.empty)
        out.append((name, value))
    return out


def test_documented_signatures_match_the_code():
    """Every call the README's API tables show has the code's parameters, names and defaults (the
    synchronous API's first arguments are abbreviated: ``sd``, ``dir``)."""
    import ckptd

    calls = [re.findall(r"`(?:ckptd\.)?(\w+)\(([^`]*)\)`", cells[0]) for cells in _table("## Synchronous API", "call")]
    seen = set()
    for name, args in (c for row in calls for c in row):
        assert _documented_params(args, positional_names=False) == _params(getattr(ckptd, name), False), name
        seen.add(name)
    assert seen >= {
        "save",
        "load",
        "load_common_state_dict",
        "load_tensors_metadata",
        "load_sharded_metadata",
        "load_plain_tensors",
    }
    seen = set()
    for cells in _table("## Asynchronous saves", "`Checkpointer`"):
        owner = ckptd.SaveHandle if cells[0] == "`SaveHandle`" else ckptd.Checkpointer
        for name, args in re.findall(
            r"`\.?(\w+)\(([^`]*)\)`", " ".join(cells[:2] if owner is ckptd.SaveHandle else cells[:1])
        ):
            fn = owner.__init__ if name == owner.__name__ else getattr(owner, name)
            assert _documented_params(args) == _params(fn), f"{owner.__name__}.{name}"
            seen.add(f"{owner.__name__}.{name}")
    public = {
        f"Checkpointer.{n}"
        for n in vars(ckptd.Checkpointer)
        if not n.startswith("_") and callable(getattr(ckptd.Checkpointer, n))
    }
    assert public | {"Checkpointer.Checkpointer"} <= seen | {"Checkpointer.pending"}, public - seen
    assert {"SaveHandle.done", "SaveHandle.wait"} <= seen


def test_every_error_the_readme_names_is_a_public_name_of_ckptd():
    """The README tells users to catch these: each is ``ckptd.<Name>`` (from ckptd.errors, so
    ``except`` needs no deeper import), and the one ckptd raises."""
    import ckptd
    from ckptd import errors
    from ckptd.storage.url import parse_location

    named = set(re.findall(r"`(?:ckptd\.)?(?:errors\.)?([A-Z][A-Za-z]*Error)`", (REPO / "README.md").read_text()))
    internal = {"ProtocolError"}  # a reply of the wrong type from the daemon: a bug, not the user's to handle
    assert {"StorageError", "SharedMemoryFullError", "UnsupportedLocationError"} <= named
    for name in sorted(named - internal):
        assert name in ckptd.__all__, name
        assert getattr(ckptd, name) is getattr(errors, name), name
        assert issubclass(getattr(ckptd, name), ckptd.CkptdError), name
    with pytest.raises(ckptd.UnsupportedLocationError, match="gs://"):
        parse_location("gs://bucket/run")
    assert issubclass(ckptd.SharedMemoryFullError, ckptd.StagingError)

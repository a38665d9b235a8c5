"""The job token: at least 16 random bytes, and a token file is adopted only when it is a private
(0600) regular file of this user. Ownership is tested by chowning real files to another uid
(these tests run as root, which may). The runtime directory is checked with CKPTD_JOB_TOKEN set
too, without following a link."""

from __future__ import annotations

import os
import secrets
import stat
import threading
from pathlib import Path

import pytest

from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv, default_runtime_dir, load_token, token_pattern
from ckptd.errors import DaemonError

OTHER_UID = 65534


def _ep(tmp_path: Path, runtime: Path, **config: str) -> tuple[Endpoints, CkptdConfig]:
    cfg = CkptdConfig.from_env({}, runtime_dir=str(runtime), **config)
    return Endpoints.for_job(tmp_path / "root", JobEnv(), cfg), cfg


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    path = tmp_path / "rt"
    path.mkdir(mode=0o700)
    return path


@pytest.mark.parametrize(
    "token, why",
    [
        ("a", "1 characters"),
        ("short-but-not-16-bytes", "22 characters"),
        ("a" * 64, "only 1 distinct"),
        ("ab" * 32, "only 2 distinct"),
        # Patterns with enough distinct characters (issue 25): repeats and sequences.
        ("01234567" * 4, "'01234567' occurs at characters 0 and 8"),
        ("0123456789abcdef" * 2, "occurs at characters 0 and 16"),
        ("my-job-token-" * 4, "occurs at characters 0 and 13"),
        ("abcdefghijklmnopqrstuvwxyz012345", "'abcdefghij' runs in sequence"),
        ("f3a91c0e7d" + "9876543210" + "b4c2e8a1d6f0", "'9876543210' runs in sequence"),
        ("c1eb3525895cc9b3" + "0" * 24, "'00000000' occurs"),  # constant ids: pytest-xdist workers must collect alike
    ],
)
def test_weak_job_tokens_are_refused_with_how_to_make_one(tmp_path, runtime, token, why):
    ep, cfg = _ep(tmp_path, runtime, job_token=token)
    with pytest.raises(DaemonError, match=r"too weak.*secrets\.token_hex\(32\)") as err:
        load_token(ep, cfg)
    assert why in str(err.value) and "CKPTD_JOB_TOKEN" in str(err.value)


def test_random_job_tokens_are_accepted(tmp_path, runtime):
    for token in (secrets.token_hex(16), secrets.token_hex(32), secrets.token_urlsafe(32)):
        ep, cfg = _ep(tmp_path, runtime, job_token=token)
        assert load_token(ep, cfg) == token.encode()


def test_the_pattern_checks_pass_random_tokens():
    """10,000 random tokens of each usual form (60,400 in all). Each is refused with probability
    below 1e-6 (a repeated substring, mostly): about 0.01 refusals are expected here, so at most 2
    are allowed (3 or more: probability about 2e-7). Asserting none failed about one run in 140."""
    refused = []
    for make in (secrets.token_hex, secrets.token_urlsafe):
        for nbytes in (16, 32, 64, 2048):
            for _ in range(10_000 if nbytes < 2048 else 200):
                token = make(nbytes).encode()
                if (why := token_pattern(token)) is not None:
                    refused.append((token, why))
    assert len(refused) <= 2, refused


def test_the_token_file_is_created_once_private_and_shared(tmp_path, runtime):
    ep, cfg = _ep(tmp_path, runtime)
    tokens: list[bytes] = []
    threads = [threading.Thread(target=lambda: tokens.append(load_token(ep, cfg))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(tokens) == 8 and len(set(tokens)) == 1 and len(tokens[0]) == 64
    st = os.lstat(ep.token_path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert sorted(os.listdir(runtime)) == [ep.token_path.name]  # no private temporary left


def _plant_token(ep: Endpoints, how: str) -> None:
    path = ep.token_path
    if how == "fifo":
        os.mkfifo(path, 0o600)
        return
    if how == "link":
        target = path.with_name("elsewhere")
        target.write_text(secrets.token_hex(32))
        target.chmod(0o600)
        path.symlink_to(target)
        return
    path.write_text(secrets.token_hex(32))  # a token someone else knows
    path.chmod(0o644 if how == "mode 0644" else 0o600)
    if how == "owned by another user":
        os.chown(path, OTHER_UID, OTHER_UID)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "how, why",
    [
        ("owned by another user", f"owned by uid {OTHER_UID}"),
        ("mode 0644", "has mode 0o644"),
        ("link", "symbolic link"),
        ("fifo", "not a regular file"),
    ],
)
def test_a_token_file_that_is_not_private_and_ours_is_refused(tmp_path, runtime, how, why):
    ep, cfg = _ep(tmp_path, runtime)
    _plant_token(ep, how)
    with pytest.raises(DaemonError, match=why) as err:
        load_token(ep, cfg)
    assert str(ep.token_path) in str(err.value) and "delete it" in str(err.value)


def test_a_runtime_dir_of_another_user_is_refused_with_a_job_token_too(tmp_path, runtime):
    os.chown(runtime, OTHER_UID, OTHER_UID)
    ep, cfg = _ep(tmp_path, runtime, job_token=secrets.token_hex(32))
    with pytest.raises(DaemonError, match=rf"owned by uid {OTHER_UID}.*CKPTD_RUNTIME_DIR"):
        load_token(ep, cfg)


def test_a_linked_runtime_dir_is_never_followed(tmp_path, monkeypatch):
    """No CKPTD_RUNTIME_DIR: an attacker's link where the default runtime directory goes (here
    under XDG_RUNTIME_DIR; /tmp/ckptd-<uid> without it takes the same path) is refused: the
    victim's directory it points to is neither chmod'ed nor given the token."""
    xdg, victim = tmp_path / "xdg", tmp_path / "victims-dir"
    xdg.mkdir()
    victim.mkdir(mode=0o755)
    (xdg / "ckptd").symlink_to(victim)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert default_runtime_dir() == xdg / "ckptd"
    cfg = CkptdConfig.from_env({})
    ep = Endpoints.for_job(tmp_path / "root", JobEnv(), cfg)
    with pytest.raises(DaemonError, match="is a symbolic link.*CKPTD_RUNTIME_DIR"):
        load_token(ep, cfg)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755 and list(victim.iterdir()) == []


def test_a_configured_runtime_dir_others_may_enter_is_refused_not_chmodded(tmp_path, monkeypatch):
    """CKPTD_RUNTIME_DIR naming a directory others may enter (here one as /tmp is, mode 1777) was
    made 0700, locking every other user out of it; it is refused now, and left as it is. A default
    directory, ckptd's own, is still made 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    ep, cfg = _ep(tmp_path, shared)
    with pytest.raises(DaemonError, match=rf"{shared} \(CKPTD_RUNTIME_DIR\) has mode 0o1777: .*chmod 700 {shared}"):
        load_token(ep, cfg)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and list(shared.iterdir()) == []
    os.chmod(shared, 0o750)  # a group may enter
    with pytest.raises(DaemonError, match=r"has mode 0o750"):
        load_token(ep, cfg)
    xdg = tmp_path / "xdg"
    (xdg / "ckptd").mkdir(parents=True)
    os.chmod(xdg / "ckptd", 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    cfg = CkptdConfig.from_env({})
    load_token(Endpoints.for_job(tmp_path / "root", JobEnv(), cfg), cfg)
    assert stat.S_IMODE((xdg / "ckptd").stat().st_mode) == 0o700

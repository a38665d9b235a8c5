"""Making a test process obey file modes, so that a file's mode can deny reading it for real
(EACCES): root ignores them unless it drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH."""

from __future__ import annotations

import ctypes
import os

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def obey_file_modes() -> str | None:
    """Drop the capabilities that let root ignore file modes from this process (another user's
    obeys them already); why it could not, or None."""
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return f"capget failed: {os.strerror(ctypes.get_errno())}"
    keep = ~((1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)) & 0xFFFFFFFF
    for caps in data:
        caps.effective &= keep
        caps.permitted &= keep
        caps.inheritable &= keep
    if libc.capset(ctypes.byref(header), data) != 0:
        return f"capset failed: {os.strerror(ctypes.get_errno())}"
    return None

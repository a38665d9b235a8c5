"""Shared-memory staging: owner-only /dev/shm segments and the ranks' staging rings."""

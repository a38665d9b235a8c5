"""Checkpoint roots behind one interface: a POSIX directory (rename commits) or an S3 prefix
(commit-record objects). See :mod:`ckptd.roots.base`."""

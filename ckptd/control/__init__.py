"""The ZeroMQ control plane: message protocol and codec, CurveZMQ keys and sockets, attempt ids,
endpoints, and the daemon's pid-file lock (pidfile)."""

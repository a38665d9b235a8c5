"""The ZeroMQ control plane: message protocol, authenticated codec, sockets, endpoints."""

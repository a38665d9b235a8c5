"""The per-node daemon (writers) and the per-job coordinator (commits); see ckptd.daemon.node."""

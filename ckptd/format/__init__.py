"""The torch_dist on-disk format: a checkpoint directory's layout and a root's (rootlayout), item
records, save planning (saveplan), data files, DCP metadata, commit steps."""

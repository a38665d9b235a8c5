"""The torch_dist on-disk format: layout, item records, data files, DCP metadata, commit steps."""

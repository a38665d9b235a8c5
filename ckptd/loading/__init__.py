"""Loading onto any parallel layout.

``view`` (the checkpoint as sources in global coordinates, legacy grid translation) ->
``plan`` (requested boxes, N-D or flattened, intersected with sources) -> ``execute`` (byte-range
reads located by ``rawitem`` inside each item's torch.save stream); ``strict`` handles key
mismatches and ``loader`` runs the pipeline behind :func:`ckptd.load`. Key mapping rules live in
:mod:`ckptd.loading.keymap`.
"""

"""Checkpoints: the on-disk format, saving and loading, the layout-free reader, resharding."""

"""Graph data: datasets, partitioners and the on-disk partition format."""

"""The on-storage format, shared by the writer, ``load`` and the CLI: layout, manifest, checksums, shards, verify. It never imports the training side or the writer."""

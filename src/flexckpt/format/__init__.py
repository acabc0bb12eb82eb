"""The on-disk format: file names, the manifest's model and its parsing, chunk tables, codecs,
checksums and the write plan that fixes where every byte lies."""

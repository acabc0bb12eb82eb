"""Converters between flexckpt checkpoints and other formats: DCP in and out
(``dcp``), consolidated safetensors out (``safetensors_out``), the batching they share
(``tensor_stream``) and their ``flexckpt`` subcommands (``cli``). They use only the public
``Checkpointer``, never the file format."""

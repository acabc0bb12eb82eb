"""flextrain: the minimal trainer that hosts zephon_state, shards with flexshard and
checkpoints with flexckpt (issue 8: being built)."""

"""flexckpt: async checkpoints with zero collectives on save, loadable at any world size."""

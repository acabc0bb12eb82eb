"""A training state: its leaves (tensors, DTensors, plain, per-lane and per-rank values), its
container tree, and the walk that turns it into tensor specs."""

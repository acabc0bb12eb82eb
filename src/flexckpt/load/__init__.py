"""The load path: match and check the target, plan the reads, fetch and verify, place."""

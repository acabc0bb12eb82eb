"""zephon_state: a training-time data pipeline whose global batch does not depend on the number of ranks."""

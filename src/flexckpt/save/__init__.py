"""The save path: the pipeline's threads, staging, the writer, the records and the commit."""

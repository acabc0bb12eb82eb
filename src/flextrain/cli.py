"""Command line of flextrain (placeholder until the trainer lands)."""
import sys


def main(argv: list[str] | None = None) -> int:
    print("flextrain: not built yet", file=sys.stderr)
    return 2

from zeppelin.schemas.common import InputError


def not_implemented(command: str) -> None:
    """Commands whose implementation has not landed yet exit cleanly with code 2."""
    import sys

    print(f"zeppelin: error: `zeppelin {command}` is not implemented yet", file=sys.stderr)
    raise SystemExit(2)


__all__ = ["not_implemented", "InputError"]

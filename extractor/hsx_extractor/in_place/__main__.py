"""``python -m hsx_extractor.in_place specforge|speculators ARGS``: the trainer's own command line
(``specforge ARGS``, ``speculators ARGS``) with hsx's in-place seam installed first."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("specforge", "speculators"):
        print("usage: python -m hsx_extractor.in_place specforge|speculators ARGS (the trainer's own arguments)",
              file=sys.stderr)  # fmt: skip
        return 2
    trainer, args = argv[0], argv[1:]
    sys.argv = [trainer, *args]
    if trainer == "specforge":
        from hsx_extractor.in_place.specforge import install

        install()
        from specforge.cli import main as specforge_main

        return int(specforge_main() or 0)
    from hsx_extractor.in_place.speculators import register

    register()
    from speculators.__main__ import app

    app()  # a typer app: exits itself
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

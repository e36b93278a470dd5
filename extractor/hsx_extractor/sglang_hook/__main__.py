"""``python -m hsx_extractor.sglang_hook install-pth [DIR]``: put the activation file in site-packages.

Installing the package only places ``hsx_sglang_hook.pth`` inside the package; Python reads
``.pth`` files from site directories, so the image build copies it there with this command.
"""

from __future__ import annotations

import argparse
import shutil
import sysconfig
from pathlib import Path

PTH_NAME = "hsx_sglang_hook.pth"


def install_pth(site_dir: Path) -> Path:
    source = Path(__file__).with_name(PTH_NAME)
    if not site_dir.is_dir():
        raise SystemExit(f"{site_dir} is not a directory")
    target = site_dir / PTH_NAME
    shutil.copyfile(source, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsx_extractor.sglang_hook")
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install-pth", help=f"copy {PTH_NAME} into a site-packages directory")
    install.add_argument("site_dir", nargs="?", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    args = parser.parse_args(argv)
    print(install_pth(args.site_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

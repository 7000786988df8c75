"""The ``mlxc`` command line: lint, build, verify, generate."""

from __future__ import annotations

import sys

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxc")
def main() -> None:
    """mlxc: compile declarative model specs to MLX and run them."""


# --- generate (runtime) -------------------------------------------------------------------
# --- end generate ---------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())

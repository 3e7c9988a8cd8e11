"""The `stepgrpo` console script, above the flows it runs (`stepgrpo_cli.app`)."""

from stepgrpo_cli.app import app

__all__ = ["app"]

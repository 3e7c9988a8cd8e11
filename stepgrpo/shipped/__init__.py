"""The shipped model and recipes: `configs/` and `models/` here are links to the repository's
folders, which a wheel holds as files (`pyproject.toml`'s package data); `stepgrpo.paths` finds them."""

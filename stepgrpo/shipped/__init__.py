"""The shipped model and recipes of an installed stepgrpo: a wheel holds the repository's
`models/` and `configs/` here (`pyproject.toml`'s package-dir); in a checkout they are read
where they are (`stepgrpo.paths`)."""

"""How the shipped `shapes` model was made and judged: its pretraining and its evaluation (above
`shapes` and `rewards`, which they use; nothing imports them but the pretrain flow and the CLI)."""

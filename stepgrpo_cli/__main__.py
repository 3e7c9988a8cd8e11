"""`python -m stepgrpo_cli ...`: the console script."""

from stepgrpo_cli import main

main()

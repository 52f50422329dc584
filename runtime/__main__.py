"""`python -m runtime serve ...`: the same as the `runtime` command."""

from runtime.cli import main

main()

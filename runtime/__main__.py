"""`python -m runtime serve ...`: the same as the `runtime` command."""

from runtime.cli.main import main

main()
